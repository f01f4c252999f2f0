"""This rank's shards of every chunk, in flat arenas allocated once per placement.

A placement is where a chunk's shard and optimizer states live: ``"device"`` (the compute
device, updated there) or ``"host"`` (pinned host memory, updated on the CPU). Each placement
holds its arenas laid out chunk after chunk, trainable chunks first:

    param      compute dtype   gathered into the rCache before use (see below for trainable chunks)
    grad       compute dtype   reduce-scattered gradients (trainable chunks only; host only, see below)
    state      adam_state.py   the optimizer state of the trainable chunks: the fp32 master the
                               optimizer updates (aliases ``param`` in fp32 runs) and the moments
                               (fp32, or 8-bit codes and their blocks' scales)

so one kernel call updates a placement, guided by a static list of per-group segments.

On the device in a mixed-precision run the trainable chunks keep no compute-dtype copy: a gather
casts the fp32 master straight into the rCache (``casts_on_gather``), bitwise what the update's
bf16 copy held (both round to nearest even), so 2 bytes per element more optimizer state fit on
the GPU. Offloaded chunks keep theirs: it is what crosses PCIe, at half the bytes of the master.

Gradient shards of on-device chunks are not in an arena either: each is allocated when its
chunk is first reduced in a step and freed by ``zero_grad`` (``ChunkState.grad``), so GPU memory
holds them only from backward to the update, past the loss's activation peak; the search counts
them against the activations freed by then (``search/memory.py``). Pinned host arenas keep theirs:
the CPU update and the device lane read them by offset, and host memory has no activation peak.
Sizes: docs/runtime.md, "Semantics worth knowing".

The fill runs torch's CPU work (zeroing, casts on the host) on the rank's share of the cores
(``host.core_share``; torchrun leaves each rank one thread), and casts on the GPU where the
arena is there: a host-to-GPU copy moves a weight in its own dtype (bf16: half of fp32's bytes).

[Note: host memory during the fill]
The planner counts the model's own host copy of its weights as free for the arenas
(``host.py``, [Note: host memory as the run will have it]), so the two must not be held at once:
host arenas are allocated untouched (no page taken yet) and each chunk's part of them is zeroed
(first touched) just before its weights are written; with ``release`` each parameter's own storage
is then let go, so the host holds at most the larger of the two plus one chunk. Host arenas are
page-locked after the fill (``cudaHostRegister`` keeps their values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..adam_state import AdamState, AdamTensors
from ..config import Where
from ..host import core_share, local_ranks
from ..progress import Bar, progress
from .host_memory import empty_arena, pin_host
from .layout import ChunkLayout, ChunkSpec, GroupRange, Slot

__all__ = [
    "Where",
    "ShardArenas",
    "Weights",
    "own_part",
    "build_arenas",
    "casts_on_gather",
    "grads_on_demand",
    "write_param",
    "release_param",
    "shard_overlap",
]

Weights = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``weights(param, start, numel)``: elements ``[start, start + numel)`` of ``param``'s flattened
starting value (``numel`` may be 0), in the parameter's dtype (``weights/source.WeightSource.part``)."""


def own_part(p: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """The parameter's own current value as the starting value."""
    return p.detach().reshape(-1)[start : start + numel]


def casts_on_gather(placement: Where, dtype: torch.dtype) -> bool:
    """Whether trainable shards of this placement keep no compute-dtype copy and gathers cast their
    fp32 master instead: on the device, in mixed precision (see the module docstring)."""
    return placement == "device" and dtype != torch.float32


def grads_on_demand(placement: Where) -> bool:
    """Whether gradient shards of this placement are allocated per chunk at its first reduction of
    a step and freed by ``zero_grad`` rather than kept in an arena: on the device (module docstring)."""
    return placement == "device"


@dataclass(eq=False)
class ShardArenas:
    placement: Where
    device: torch.device
    param: torch.Tensor
    """Compute-dtype shards: of every chunk, or of the frozen ones only where ``cast_on_gather``."""
    grad: torch.Tensor
    """Gradient shards of the trainable chunks; empty on the device (allocated per chunk on demand)."""
    state: AdamTensors
    """The trainable shards' optimizer state: master and moments (``adam_state.py``)."""
    trainable_numel: int
    cast_on_gather: bool = False
    """Trainable shards have no compute-dtype copy: gathers cast the master (``casts_on_gather``)."""
    segments: list[GroupRange] = field(default_factory=list)
    offsets: dict[int, int] = field(default_factory=dict)
    """Chunk index → offset of its shard in every arena of this placement (``param``: see ``param_base``)."""

    @property
    def master(self) -> torch.Tensor:
        return self.state.master

    @property
    def master_is_param(self) -> bool:
        return self.master.data_ptr() == self.param.data_ptr() and self.param.numel() > 0

    @property
    def param_base(self) -> int:
        """Arena offset of ``param[0]``: without trainable copies it starts at the first frozen shard."""
        return self.trainable_numel if self.cast_on_gather else 0

    @property
    def param_copy(self) -> torch.Tensor | None:
        """The compute-dtype copy of the trainable shards that every update rewrites from the
        master; ``None`` where there is none (fp32: the master is the param; ``cast_on_gather``)."""
        if self.cast_on_gather or self.master_is_param:
            return None
        return self.param[: self.trainable_numel]

    def source(self, offset: int, numel: int, trainable: bool) -> torch.Tensor:
        """What a gather of the shard at ``offset`` reads: the master (cast on the way) where
        trainable shards have no compute-dtype copy, else the compute-dtype param."""
        if trainable and self.cast_on_gather:
            return self.master[offset : offset + numel]
        start = offset - self.param_base
        return self.param[start : start + numel]


def build_arenas(
    layout: ChunkLayout,
    placement: list[Where],
    rank: int,
    compute_device: torch.device,
    dtype: torch.dtype,
    state: AdamState,
    weights: Weights = own_part,
    release: bool = False,
) -> dict[Where, ShardArenas]:
    """Allocates the arenas and fills them from ``weights`` (by default the parameters' current values).

    The master weights are filled from the parameters in their original precision, the
    compute-dtype copy is cast from the master: a bf16 run of an fp32 model starts from the exact
    fp32 weights. ``release``: each parameter's own storage is let go once its chunk is filled
    (``release_param``; [Note: host memory during the fill]). A progress bar (``progress.py``)
    counts the chunks filled.
    """
    out: dict[Where, ShardArenas] = {}
    for where in ("device", "host"):
        members = [c for c in layout.chunks if placement[c.index] == where]
        members.sort(key=lambda c: not c.trainable)  # trainable first: state arenas are a prefix
        shard = [layout.shard_numel(c) for c in members]
        total = sum(shard)
        trainable = sum(s for c, s in zip(members, shard) if c.trainable)
        device = compute_device if where == "device" else torch.device("cpu")
        pin = where == "host" and compute_device.type == "cuda"

        def alloc(numel: int, dt: torch.dtype, device: torch.device = device) -> torch.Tensor:
            # untouched on the host (huge pages), zeroed chunk by chunk in _fill; zeroed at once on a GPU
            if device.type == "cpu":
                return empty_arena(numel, dt)
            return torch.zeros(numel, dtype=dt, device=device)

        cast = casts_on_gather(where, dtype)
        param = alloc(total - trainable if cast else total, dtype)
        master = param[:trainable] if dtype == torch.float32 else alloc(trainable, torch.float32)
        moments = {t.kind: alloc(t.entries(trainable), t.dtype) for t in state.tensors if t.moment}
        arenas = ShardArenas(
            where,
            device,
            param=param,
            grad=alloc(0 if grads_on_demand(where) else trainable, dtype),
            state=AdamTensors(state, {"master": master, **moments}),
            trainable_numel=trainable,
            cast_on_gather=cast,
        )
        offset = 0
        for c, size in zip(members, shard):
            arenas.offsets[c.index] = offset
            if c.trainable:
                arenas.segments += [
                    GroupRange(offset + o, n, g) for o, n, g in c.shard_segments(rank, layout.world_size)
                ]
            offset += size
        with (
            progress(len(members), f"elixir: filling {where} chunk shards", unit="chunk") as bar,
            _cpu_threads(core_share(local_ranks())),
        ):
            _fill(layout, members, arenas, rank, weights, release, bar)
        if pin:
            _pin(arenas)
        out[where] = arenas
    return out


@torch.no_grad()
def _fill(
    layout: ChunkLayout,
    members: list[ChunkSpec],
    arenas: ShardArenas,
    rank: int,
    weights: Weights,
    release: bool,
    bar: Bar,
) -> None:
    copy = arenas.param_copy
    for c in members:
        start, n = arenas.offsets[c.index], layout.shard_numel(c)
        if c.trainable:
            for spec, t in arenas.state.range(start, start + n).items():
                t.fill_(spec.zero)  # a moment at step 0 (its padding stays so: no piece of a checkpoint holds it)
            for t in [arenas.grad[start : start + n]] + ([copy[start : start + n]] if copy is not None else []):
                t.zero_()
        else:
            arenas.source(start, n, trainable=False).zero_()
        for s in c.slots:
            target, param_off = _shard_target(layout, arenas, c, s, rank)
            _cast_into(target, weights(layout.params[s.param], param_off, target.numel()))
        if c.trainable and copy is not None:
            copy[start : start + n].copy_(arenas.master[start : start + n])
        if release:
            for s in c.slots:
                release_param(layout.params[s.param])
        bar.update()


def _cast_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)`` with the cast on the GPU when either is there (a blocking
    cross-device ``copy_`` casts on the CPU)."""
    if value.device != target.device:
        value = value.to(target.device) if target.device.type != "cpu" else value.to(target.dtype)
    target.copy_(value)


@contextlib.contextmanager
def _cpu_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pin(arenas: ShardArenas) -> None:
    """Page-locks the filled host arenas (``pin_host``: in place, else a pinned copy, re-aliased)."""
    aliased = arenas.master_is_param
    for name in ("param", "grad"):
        setattr(arenas, name, pin_host(getattr(arenas, name)))
    state = arenas.state.tensors
    for kind in state:
        state[kind] = arenas.param[: arenas.trainable_numel] if kind == "master" and aliased else pin_host(state[kind])


def release_param(p: nn.Parameter) -> None:
    """Lets ``p``'s storage go: ``.data`` becomes a zero-stride placeholder of its shape (no memory)."""
    p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)


def shard_overlap(layout: ChunkLayout, chunk: ChunkSpec, slot: Slot, rank: int) -> tuple[int, int, int] | None:
    """``(offset in the shard, offset in the param, length)`` of the part of ``slot`` this rank holds."""
    size = layout.shard_numel(chunk)
    lo = rank * size
    a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + size)
    return (a - lo, a - slot.offset, b - a) if a < b else None


def _shard_target(
    layout: ChunkLayout, arenas: ShardArenas, chunk: ChunkSpec, slot: Slot, rank: int
) -> tuple[torch.Tensor, int]:
    """The master (or frozen param) elements this rank holds of ``slot`` (maybe none) and the
    offset of the first one in the flattened parameter."""
    shard_off, param_off, n = shard_overlap(layout, chunk, slot, rank) or (0, 0, 0)
    start = arenas.offsets[chunk.index] + shard_off
    if chunk.trainable:
        return arenas.master[start : start + n], param_off
    return arenas.source(start, n, trainable=False), param_off


@torch.no_grad()
def write_param(
    layout: ChunkLayout, arenas: ShardArenas, chunk: ChunkSpec, slot: Slot, value: torch.Tensor, rank: int
) -> None:
    """Copies this rank's part of a full parameter value into the master (or frozen param) shard."""
    target, param_off = _shard_target(layout, arenas, chunk, slot, rank)
    _cast_into(target, value.reshape(-1)[param_off : param_off + target.numel()])
