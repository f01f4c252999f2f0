"""``profile_model``: one training step (forward + loss + backward) traced on fake tensors.

What the search needs and nothing is allocated for: the order parameters are first used in, the
fetch-unit events the engine will see, the checkpointed regions and the parameters each touches,
tied parameters, buffer bytes, the compute of the step, and the activation peak — the most bytes
alive at any moment besides parameters and buffers, counting saved tensors, recomputation under
activation checkpointing, and each gradient until the engine would have copied it into its chunk —
also as it is with the held block inputs in host memory (``runtime/held_inputs.py``).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..runtime.held_inputs import LOOKAHEAD
from ..units import Unit, find_units
from .blocks import BlockStack, find_block_stack, truncated
from .fake import fake_run, loss_of
from .hooks import Markers
from .kernels import cuda_attention
from .outside import OutsideReads
from .recorder import Recorder
from .timeline import BlockPlan, Cost, Region, Segment, Timeline, UnitEvent, replay
from .trace import call_model

__all__ = [
    "BackwardSegment",
    "ParamInfo",
    "ModelProfile",
    "ProfileSummary",
    "profile_model",
    "structural_profile",
    "PROFILED_BLOCKS",
]

PROFILED_BLOCKS = 3
"""Blocks traced of a longer identical stack: the first, one standing for the middle, the last."""


@dataclass
class ParamInfo:
    name: str
    numel: int
    trainable: bool
    used: bool
    aliases: list[str] = field(default_factory=list)
    """Every other name the same tensor is reachable under (tied weights)."""


@dataclass
class BackwardSegment:
    """One segment of backward: the loss and head's, a block's, or the one after the blocks."""

    peak: int
    """Most activation bytes alive during it."""
    params: list[str]
    """Parameters whose gradients it produces: those first used by the forward segment it undoes."""


_FORWARD_OF = {"head": "mid", "bwd": "fwd", "post": "pre"}
"""The forward segment each backward segment undoes (``Timeline`` labels)."""


@dataclass
class ModelProfile:
    model: str
    dtype: str
    device: str
    inputs: list[list[int]]
    """Shapes of the batch's tensors."""
    params: list[ParamInfo]
    """In first-use order in forward; parameters the step never used come last."""
    buffer_bytes: int
    activation_peak: int
    peak_at: str
    forward_peak: int
    saved_bytes: int
    """Alive when backward starts: what forward saved for it (checkpoint inputs under AC)."""
    ac_regions: list[Region]
    unit_events: list[UnitEvent]
    compute: dict[str, Cost]
    """``fwd`` and ``bwd`` (the latter includes recomputation)."""
    blocks: BlockPlan | None
    seconds: float
    read_outside: list[str] = field(default_factory=list)
    """Parameters the forward read while no unit holding them ran (``outside.py``)."""
    backward: list[BackwardSegment] = field(default_factory=list)
    """Backward from the loss and head on, a segment per block: what is live beside the gradient
    shards on-device chunks accumulate as it goes (``search/memory.py``). Empty: no head was
    found (no block stack), nothing is known to be freed."""
    held_inputs: int = 0
    """The most bytes of held block inputs alive at once (``runtime/held_inputs.py``): what keeping
    them on the host takes of pinned host memory; 0: none (no activation checkpointing)."""
    host_activation_peak: int = 0
    """The activation peak with the held block inputs on the host: the rest of the activations at
    their most, plus ``LOOKAHEAD + 1`` of the largest held input on the GPU (in use, and coming back)."""

    @property
    def late_peak(self) -> int | None:
        """Activation peak once backward is past the loss and head; ``None``: none known."""
        return max((b.peak for b in self.backward[1:]), default=None)

    @property
    def head_params(self) -> list[str]:
        """Parameters first used in the forward of the head and loss: their gradients arrive at the
        activation peak."""
        return self.backward[0].params if self.backward else []

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def flop_classes(self) -> set[str]:
        """The size classes of the step's FLOPs (GEMM shapes, attention lengths, ...)."""
        return {cls for cost in self.compute.values() for cls in cost.flops}

    @property
    def param_bytes(self) -> int:
        return self.n_params * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def unit_order(self) -> list[str]:
        """Units in the order of their first forward call."""
        return list(dict.fromkeys(e.unit for e in self.unit_events if e.phase == "fwd"))

    def unit_indices(self, units: list[Unit]) -> list[int]:
        """Indices of ``units`` (``units.Unit``) in first-use order, the never-called ones last."""
        by_name = {u.name: u.index for u in units}
        order = [by_name[n] for n in self.unit_order() if n in by_name]
        return order + [u.index for u in units if u.index not in set(order)]

    def ac_buffer_numel(self) -> int:
        """Appendix A.3: the most elements any checkpointed region needs gathered at once."""
        numel = {p.name: p.numel for p in self.params}
        return max((sum(numel.get(n, 0) for n in r.params) for r in self.ac_regions), default=0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        d = json.loads(text)
        d["params"] = [ParamInfo(**p) for p in d["params"]]
        d["ac_regions"] = [Region(**r) for r in d["ac_regions"]]
        d["unit_events"] = [UnitEvent(e["unit"], e["phase"], Cost(**e["before"])) for e in d["unit_events"]]
        d["compute"] = {k: Cost(**v) for k, v in d["compute"].items()}
        d["backward"] = [BackwardSegment(**b) for b in d["backward"]]
        d["blocks"] = BlockPlan(**d["blocks"]) if d["blocks"] else None
        return cls(**d)

    def summary(self) -> ProfileSummary:
        """The profile's figures a plan keeps (``ElixirPlan.profile``)."""
        late = [b.peak for b in self.backward[1:]]
        return ProfileSummary(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            inputs=tuple(tuple(shape) for shape in self.inputs),
            parameters=self.n_params,
            parameter_bytes=self.param_bytes,
            buffer_bytes=self.buffer_bytes,
            activation_peak=self.activation_peak,
            peak_at=self.peak_at,
            forward_peak=self.forward_peak,
            saved_bytes=self.saved_bytes,
            held_inputs=self.held_inputs,
            host_activation_peak=self.host_activation_peak,
            late_peak=max(late, default=None),
            late_low=min(late, default=None),
            head_params=tuple(self.head_params),
            ac_regions=len(self.ac_regions),
            ac_buffer_numel=self.ac_buffer_numel(),
            tied=tuple(p.name for p in self.params if p.aliases),
            forward_flops=self.compute["fwd"].total_flops,
            backward_flops=self.compute["bwd"].total_flops,
            blocks=self.blocks,
            seconds=self.seconds,
        )


@dataclass(frozen=True)
class ProfileSummary:
    """What a plan keeps of the profiled step (``ModelProfile.summary``): sizes, the activation
    peak and where, checkpointing, compute, and how it was traced."""

    model: str
    dtype: str
    device: str
    inputs: tuple[tuple[int, ...], ...]
    """Shapes of the batch's tensors."""
    parameters: int
    parameter_bytes: int
    buffer_bytes: int
    activation_peak: int
    peak_at: str
    forward_peak: int
    saved_bytes: int
    late_peak: int | None
    """Activation peak once backward is past the loss and head; ``None``: none known."""
    late_low: int | None
    """The lowest of the backward segments' peaks after the head."""
    head_params: tuple[str, ...]
    ac_regions: int
    """Activation-checkpointed regions."""
    ac_buffer_numel: int
    tied: tuple[str, ...]
    forward_flops: int
    backward_flops: int
    """Recomputation included."""
    blocks: BlockPlan | None
    """Identical blocks replayed from a few traced ones; ``None``: every block traced."""
    seconds: float
    held_inputs: int = 0
    """``ModelProfile.held_inputs`` (plan files from before it: 0)."""
    host_activation_peak: int = 0
    """``ModelProfile.host_activation_peak`` (plan files from before it: 0)."""

    def to_dict(self) -> dict[str, object]:
        """The JSON keys of ``elixir-plan --json``'s ``profile``."""
        out = asdict(self)
        out["inputs"] = [list(s) for s in self.inputs]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileSummary:
        blocks = data.get("blocks")
        return cls(
            **{
                **data,
                "inputs": tuple(tuple(s) for s in data["inputs"]),
                "head_params": tuple(data["head_params"]),
                "tied": tuple(data["tied"]),
                "blocks": BlockPlan(**blocks) if blocks else None,
            }
        )


def profile_model(
    model: nn.Module,
    batch: object,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    units: list[Unit] | None = None,
    exact: bool = False,
) -> ModelProfile:
    """Traces one training step of ``model`` on ``batch`` (``model(**batch)`` for a dict).

    ``model`` may live on the meta device. ``dtype`` is the compute dtype (default: the model's);
    ``device`` the device the run will compute on (default: CUDA if present, else CPU); a CUDA
    run profiled where there is no GPU gets CUDA's attention kernels (``kernels.py``). ``exact``
    traces every block even when the model has a stack of identical ones (slower, the same numbers).
    """
    start = time.perf_counter()
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    emulate = device.type == "cuda" and not torch.cuda.is_available()
    if emulate:
        device = torch.device("cpu")
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    units = find_units(model, None) if units is None else units
    stack = find_block_stack(model)
    plan: BlockPlan | None = None
    segments: list[Segment] | None = None
    outside: list[str] = []
    if stack is not None and not exact and len(stack.blocks) > PROFILED_BLOCKS + 1:
        plan = BlockPlan(stack.prefix, len(stack.blocks), PROFILED_BLOCKS)
        try:
            with truncated(stack, PROFILED_BLOCKS):
                kept = {id(m) for m in model.modules()}
                segments, outside, held = _trace(
                    model, batch, dtype, device, [u for u in units if id(u.module) in kept], stack, emulate
                )
        except Exception:  # a forward that needs all its blocks (e.g. indexes them by config): trace them all
            segments = None
        if segments is None or not _replayable(segments, plan):
            segments, plan = None, None
    if segments is None:
        segments, outside, held = _trace(model, batch, dtype, device, units, stack, emulate)
    where = "cuda (kernels chosen as on a GPU, traced on cpu)" if emulate else str(device)
    profile = _assemble(model, batch, segments, plan, dtype, where, time.perf_counter() - start, held)
    profile.read_outside = outside
    return profile


def structural_profile(model: nn.Module, units: list[Unit], dtype: torch.dtype) -> ModelProfile:
    """What can be known without a batch: units in registration order forward and reversed
    backward, no activations (``activation_peak`` 0) and no compute."""
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    params = [ParamInfo(n, p.numel(), p.requires_grad, True, aliases[id(p)][1:]) for n, p in model.named_parameters()]
    events = [UnitEvent(u.name, "fwd", Cost()) for u in units] + [
        UnitEvent(u.name, "bwd", Cost()) for u in reversed(units)
    ]
    buffers = {id(b): b for b in model.buffers()}.values()
    return ModelProfile(
        model=type(model).__name__,
        dtype=str(dtype).removeprefix("torch."),
        device="none",
        inputs=[],
        params=params,
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        activation_peak=0,
        peak_at="not profiled (no example batch)",
        forward_peak=0,
        saved_bytes=0,
        ac_regions=[],
        unit_events=events,
        compute={"fwd": Cost(), "bwd": Cost()},
        blocks=None,
        seconds=0.0,
    )


def _trace(
    model: nn.Module,
    batch: object,
    dtype: torch.dtype,
    device: torch.device,
    units: list[Unit],
    stack: BlockStack | None,
    emulate: bool,
) -> tuple[list[Segment], list[str], int]:
    """The step's segments, the parameters its forward read outside their units, and the largest held
    block input's bytes."""
    timeline = Timeline()
    names = {id(p): n for n, p in model.named_parameters()}
    kernels = cuda_attention() if emulate else contextlib.nullcontext()
    with fake_run(model, batch, dtype, device, on_launch=timeline.kernel_launch) as fake, kernels:
        recorder = Recorder(timeline, {id(f): names[pid] for pid, f in fake.params.items()})
        recorder.preexisting(
            [*fake.params.values(), *fake.buffers, *(t for t in tree_leaves(fake.batch) if isinstance(t, torch.Tensor))]
        )
        markers = Markers(model, timeline, units, stack, recorder.hold)
        outside = OutsideReads(units, fake.params, names)
        try:
            with torch.enable_grad(), recorder:
                with outside.watching():
                    output = call_model(model, fake.batch)
                    loss = loss_of(output)
                del output
                timeline.phase = "bwd"
                timeline.mark("head")
                loss.backward()
                del loss
        finally:
            recorder.close()
            markers.remove()
    return timeline.segments, list(outside.found), timeline.largest_held


def _replayable(segments: list[Segment], plan: BlockPlan) -> bool:
    """The traced blocks must show the same pattern, renamed, for replay to stand for the rest."""
    by_key = {(s.label, s.block): s for s in segments if s.block is not None}
    blocks = range(plan.profiled)
    if any((label, b) not in by_key for label in ("fwd", "bwd") for b in blocks):
        return False
    if not any(s.label == "mid" for s in segments):
        return False

    def pattern(label: str, b: int, inside_only: bool) -> tuple[list[str], list[tuple[str, str]], list[list[str]]]:
        def keep(name: str) -> bool:
            return not inside_only or plan.rename(name, b, -1) != name

        s = by_key[label, b]
        return (
            [plan.rename(p, b, 0) for p in s.params if keep(p)],
            [(plan.rename(e.unit, b, 0), e.phase) for e in s.events if keep(e.unit)],
            [[plan.rename(p, b, 0) for p in r.params if keep(p)] for r in s.regions],
        )

    # Blocks 1.. stand for the others and must match exactly; block 0 is replayed as itself and
    # may border on the embeddings (whose backward event can land in its segment).
    for label in ("fwd", "bwd"):
        if any(pattern(label, b, False) != pattern(label, 1, False) for b in blocks[2:]):
            return False
        if pattern(label, 0, True) != pattern(label, 1, True):
            return False
    return True


def _assemble(
    model: nn.Module,
    batch: object,
    segments: list[Segment],
    plan: BlockPlan | None,
    dtype: torch.dtype,
    device: str,
    seconds: float,
    largest_held: int,
) -> ModelProfile:
    replays = replay(segments, plan)
    order = list(dict.fromkeys(r.rename(plan, n) for r in replays for n in r.segment.params))
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    registered = {n: p for n, p in model.named_parameters()}
    used = set(order)
    order += [n for n in registered if n not in used]
    params = [
        ParamInfo(n, registered[n].numel(), registered[n].requires_grad, n in used, aliases[id(registered[n])][1:])
        for n in order
    ]
    peak, where = max(((r.peak, _where(r.segment, r.block)) for r in replays), key=lambda x: x[0])
    held = max((r.held_at_start for r in replays), default=0)
    host_peak = min(peak, max(r.peak_unheld for r in replays) + (LOOKAHEAD + 1) * largest_held) if held else peak
    compute = {"fwd": Cost(), "bwd": Cost()}
    for r in replays:
        compute[r.segment.phase].add(r.segment.cost)
    head = next((r for r in replays if r.segment.label == "head"), None)
    forward_params: dict[tuple[str, int | None], list[str]] = {}
    for r in replays:
        if r.segment.phase == "fwd":
            forward_params.setdefault((r.segment.label, r.block), []).extend(
                r.rename(plan, n) for n in r.segment.params
            )
    buffers = {id(b): b for b in model.buffers()}.values()
    return ModelProfile(
        model=type(model).__name__,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        inputs=[list(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)],
        params=params,
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        activation_peak=peak,
        peak_at=where,
        forward_peak=max(r.peak for r in replays if r.segment.phase == "fwd"),
        saved_bytes=head.segment.start + head.shift if head else 0,
        ac_regions=[
            Region(r.rename(plan, g.name), [r.rename(plan, p) for p in g.params])
            for r in replays
            for g in r.segment.regions
        ],
        unit_events=[UnitEvent(r.rename(plan, e.unit), e.phase, e.before) for r in replays for e in r.segment.events],
        compute=compute,
        blocks=plan,
        seconds=seconds,
        backward=[
            BackwardSegment(
                r.segment.peak + r.shift, forward_params.get((_FORWARD_OF.get(r.segment.label, ""), r.block), [])
            )
            for r in (replays[replays.index(head) :] if head is not None else [])
        ],
        held_inputs=held,
        host_activation_peak=host_peak,
    )


def _where(segment: Segment, block: int | None) -> str:
    return {
        "pre": "forward, before the blocks",
        "fwd": f"forward of block {block}",
        "mid": "forward of the head and loss",
        "head": "backward of the loss and head",
        "bwd": f"backward of block {block}",
        "post": "backward, after the blocks",
    }[segment.label]
