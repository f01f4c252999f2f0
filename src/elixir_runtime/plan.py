"""``ElixirPlan``: chunk size, rCache size and where each chunk's shard lives, with its cost.

The planner (``planner.py``) decides a plan before any training memory is allocated; this module
holds what a plan is and its rules: the rCache bounds, the user's explicit choices (``n_blocks``,
``offload``), the memory count and whether it fits this machine (``PlanError`` with the numbers).

[Note: one plan object] A plan is built once (``resolve_plan``) and never changed: ``ElixirPlan``
is a frozen dataclass tree holding exactly what its JSON file holds, typed (the search's report,
the profile's summary, each chunk's parameters), so a plan read from a file and the plan a run
decided are the same kind of object, rendered by one renderer (``plan_view.py``). A variant (for
another batch, another file) is ``dataclasses.replace`` of it. The objects it was decided on,
which the runtime builds from (parameter table, layout, each unit's chunks), are this process's
and stay out of it: ``LivePlan``, beside it in ``Planned``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import torch

from .adam_state import AdamState, Moments
from .chunk.layout import ChunkLayout
from .config import ElixirConfig, PlanError, Where
from .gpu_limit import device_capacity, process_limit
from .host import HostMemory
from .profiler.profile import ProfileSummary
from .runtime.batch_guard import BatchGuard
from .search.budget import Budget
from .search.loop import SearchResult, resident_chunks
from .search.memory import ArenaBytes, GradWindow
from .search.placement import offloaded_chunks
from .search.report import Alternative, SearchReport
from .search.step_time import StepTime
from .units import ParamTable

__all__ = [
    "DEVICE_MEMORY",
    "PLAN_FORMAT",
    "ElixirPlan",
    "LivePlan",
    "PlanMemory",
    "PlannedChunk",
    "Planned",
    "resolve_plan",
    "check_fits",
]

DEVICE_MEMORY = ("rcache", "private", "device_shards", "device_grads", "lane_staging")
"""The fields of ``PlanMemory`` that are GPU memory per rank for model states and rCache: what
``device_bytes`` sums and the budget's ``U_allowed`` bounds (activations and buffers come on top)."""

PLAN_FORMAT = 2
"""The plan file's format (its ``format`` key). 2 (elixir-hf 0.2.0): typed, with ``profile`` and
``chunks``. A file without the key is of format 1 (elixir-hf 0.1.0: the same keys less those two),
which is refused, naming elixir-hf 0.2.0 as the last release that reads it (``ElixirPlan.from_dict``)."""


@dataclass(frozen=True)
class PlanMemory:
    """Predicted bytes per rank by arena, with the search's formula (``search.memory.ArenaBytes``)."""

    rcache: int = 0
    private: int = 0
    device_shards: int = 0
    device_grads: int = 0
    """The GPU's gradient shards beyond the activations freed under them (``ArenaBytes.grads``)."""
    lane_staging: int = 0
    host_shards: int = 0
    host_activations: int | None = None
    """Pinned host memory for the held block inputs (``ElixirPlan.activations`` ``"host"``); ``None``: none."""
    activations: int | None = None
    """The profiled activation peak (with the held block inputs where the plan keeps them); ``None``: not searched."""
    buffers: int | None = None
    """The model's buffers; ``None``: not searched."""

    @property
    def device(self) -> int:
        return sum(getattr(self, k) for k in DEVICE_MEMORY)

    def to_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of the plan's layout, in chunk order: its size, kind and parameters (their first
    names), which name the layers it holds (``plan_view.chunk_layers``)."""

    numel: int
    private: bool
    trainable: bool
    params: tuple[str, ...]


class PlanSettings(TypedDict):
    """``ElixirPlan.settings()``: the ``ElixirConfig`` fields a plan fixes."""

    mode: Literal["static"]
    chunk_size: int
    n_blocks: int
    offload: list[int]
    gpu_memory: int | None
    device_assisted_update: bool
    moments: Moments
    activations: Where


@dataclass(frozen=True)
class ElixirPlan:
    """What the engine runs: the decided values, exactly the JSON file's (``to_json``/``from_json``).
    Frozen: derive a variant with ``dataclasses.replace`` ([Note: one plan object])."""

    chunk_size: int
    n_blocks: int
    offload: tuple[int, ...]
    """Indices of chunks whose shard and optimizer state live in host memory."""
    n_chunks: int
    world_size: int
    dtype: str
    min_blocks: int
    max_blocks: int
    moments: Moments = "fp32"
    """How Adam's moments are stored (``ElixirConfig.moments``; files from before it: exact)."""
    activations: Where = "device"
    """Where the held block inputs wait for their recompute (``ElixirConfig.activations``, ``runtime/held_inputs.py``)."""
    device_lane: int = 0
    """Elements per staging buffer of the device update lane (``runtime/device_lane.py``): the GPU
    updates slices of offloaded chunks beside the CPU; 0: the CPU alone (nothing offloaded, or
    ``ElixirConfig.device_assisted_update`` off)."""
    memory: PlanMemory = field(default_factory=PlanMemory)
    predicted: StepTime | None = None
    """Predicted seconds per optimizer step and its parts; ``None`` when the plan was not searched."""
    budget: Budget | None = None
    """The memory budget the search respected; ``None`` when the plan was not searched."""
    search: SearchReport | None = None
    """Why this plan: the chunk sizes simulated, I(n)/J(n) at the choice, rates, hardware, timings;
    ``None`` when the plan was not searched."""
    alternatives: tuple[Alternative, ...] = ()
    """Rigid plans of the same layout (ZeRO-2/3-like offload-all, rCache max/min) with their
    predicted memory and step time."""
    gpu_memory: int | None = None
    """``ElixirConfig.gpu_memory`` the plan was made under (bytes per GPU; ``None``: no cap); a run
    from this plan file is held to it again."""
    batch_shape: tuple[int, int] | None = None
    """``(batch, seq)`` of the example batch the plan was made with (its activations are the ones
    budgeted); a larger training batch runs where the budget provably holds it, else is refused
    before its forward (``runtime/batch_guard.py``). ``None``: no batch
    (and plan files from before it was recorded)."""
    profile: ProfileSummary | None = None
    """The profiled step the search planned from; ``None`` when not searched."""
    chunks: tuple[PlannedChunk, ...] = ()
    """Each chunk of the layout (``resolve_plan``'s); empty in a plan built without them."""

    def __post_init__(self) -> None:  # JSON and callers give lists: the plan keeps tuples
        object.__setattr__(self, "offload", tuple(self.offload))
        if self.batch_shape is not None:
            object.__setattr__(self, "batch_shape", tuple(self.batch_shape))

    def settings(self) -> PlanSettings:
        """The ``ElixirConfig`` fields that make the planner decide this plan again for its model:
        static, its chunk size, rCache, offloaded chunks, GPU cap and update lane (a plan file's)."""
        return {
            "mode": "static",
            "chunk_size": self.chunk_size,
            "n_blocks": self.n_blocks,
            "offload": list(self.offload),
            "gpu_memory": self.gpu_memory,
            "device_assisted_update": self.device_lane > 0,
            "moments": self.moments,
            "activations": self.activations,
        }

    def placement(self) -> list[Where]:
        off = set(self.offload)
        return ["host" if i in off else "device" for i in range(self.n_chunks)]

    @property
    def device_bytes(self) -> int:
        return self.memory.device

    @property
    def host_bytes(self) -> int:
        return self.memory.host_shards + (self.memory.host_activations or 0)

    @property
    def predicted_step_s(self) -> float | None:
        """Predicted seconds per optimizer step; ``None`` when the plan was not searched."""
        return None if self.predicted is None else float(self.predicted.total)

    @property
    def activation_room(self) -> int | None:
        """The most activation bytes the budget holds beside the plan's GPU arenas: they fit
        ``U_allowed = F_alloc·(capacity − buffers − F_frag·A)`` for ``A`` up to ``(capacity − buffers −
        device / F_alloc) / F_frag``; ``None`` without a profiled budget (``runtime/batch_guard.py``)."""
        b = self.budget
        if b is None or self.profile is None:
            return None
        return max(0, int((b.capacity - b.buffers - self.device_bytes / b.f_alloc) / b.f_frag))

    def batch_guard(self) -> BatchGuard:
        """What a run of this plan does with a training batch larger than ``batch_shape``: runs it where
        ``activation_room`` holds it, else refuses it; warns where there is no room to judge by."""
        room = self.activation_room
        if room is None or self.budget is None:
            return BatchGuard(self.batch_shape)
        return BatchGuard(self.batch_shape, self.budget.activations, room)

    @property
    def device_peak_bytes(self) -> int:
        """Model states and rCache plus the profiled activation peak and buffers."""
        return self.device_bytes + (self.memory.activations or 0) + (self.memory.buffers or 0)

    def to_dict(self) -> dict[str, object]:
        """The file's keys; ``predicted``/``budget``/``search`` are ``{}`` and ``profile`` ``None``
        when not searched."""
        return {
            "format": PLAN_FORMAT,
            **{f.name: getattr(self, f.name) for f in fields(self)},  # the scalars; the rest as JSON has them:
            "offload": list(self.offload),
            "batch_shape": None if self.batch_shape is None else list(self.batch_shape),
            "memory": self.memory.to_dict(),
            "predicted": {} if self.predicted is None else self.predicted.to_dict(),
            "budget": {} if self.budget is None else self.budget.to_dict(),
            "search": {} if self.search is None else self.search.to_dict(),
            "alternatives": [a.to_dict() for a in self.alternatives],
            "profile": None if self.profile is None else self.profile.to_dict(),
            "chunks": [{**asdict(c), "params": list(c.params)} for c in self.chunks],
        }

    def to_json(self) -> str:
        """``to_dict`` plus ``predicted_step_s`` for readers of the file (derived: ignored on load)."""
        return json.dumps({**self.to_dict(), "predicted_step_s": self.predicted_step_s}, indent=2)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ElixirPlan:
        """A JSON text or the path of a file holding one (named in ``from_dict``'s errors)."""
        text, source = str(text_or_path), "the plan"
        if not text.lstrip().startswith("{"):
            text, source = Path(text_or_path).read_text(), f"plan file {text_or_path}"
        return cls.from_dict(json.loads(text), source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the plan") -> ElixirPlan:
        """The plan a saved ``to_json`` document of format ``PLAN_FORMAT`` describes: the one plan
        reader (``elixir_hf``'s plan files too). Another format (format 1: no ``format`` key), and
        unknown keys, are a ``ValueError`` naming ``source``, the format or keys, and the fix;
        ``predicted_step_s`` is derived, ignored."""
        data = {k: v for k, v in data.items() if k != "predicted_step_s"}
        version = data.pop("format", 1)
        if version == 1:
            raise ValueError(
                f'{source} is of plan format 1 (no "format" key: written by elixir-hf 0.1.x); this elixir-hf reads '
                f"format {PLAN_FORMAT} (elixir-hf 0.2.0 reads both): plan again with this one (`elixir-plan ... --json`, "
                "or --elixir auto, whose run saves elixir_plan.json)"
            )
        if version != PLAN_FORMAT:
            raise ValueError(
                f"{source} is of plan format {version!r}, not one this elixir-hf reads ({PLAN_FORMAT}): a newer "
                "elixir-hf wrote it; upgrade elixir-hf, or plan again with this one"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source} is not an ElixirPlan: unknown keys {unknown}; a plan has {sorted(known)}")
        memory, predicted, budget = data.pop("memory", {}), data.pop("predicted", {}), data.pop("budget", {})
        search, alternatives = data.pop("search", {}), data.pop("alternatives", ())
        profile, chunks = data.pop("profile", None), data.pop("chunks", ())
        return cls(
            **data,
            memory=PlanMemory(**memory),
            predicted=StepTime.from_dict(predicted) if predicted else None,
            budget=Budget.from_dict(budget) if budget else None,
            search=SearchReport.from_dict(search) if search else None,
            alternatives=tuple(Alternative.from_dict(a) for a in alternatives),
            profile=ProfileSummary.from_dict(profile) if profile else None,
            chunks=tuple(PlannedChunk(**{**c, "params": tuple(c["params"])}) for c in chunks),
        )


@dataclass(frozen=True, eq=False)
class LivePlan:
    """The objects a plan was decided on, which the runtime builds from: this process's
    parameters, so never in the file; on a plan given (a plan file, rank 0's decision on the other
    ranks) built here from its chunk size."""

    param_table: ParamTable
    """The parameters in first-use order the layout was built from."""
    layout: ChunkLayout
    unit_chunks: tuple[tuple[int, ...], ...]
    """The chunks each unit's hooks acquire (``param_table.units`` order)."""
    root_chunks: tuple[int, ...]
    """The (private) chunks of the parameters read outside their module's call (``ParamTable.resident``),
    which the model's own forward acquires before anything else runs."""
    grad_window: GradWindow
    """What the GPU's gradient shards share memory with (``search.memory.grad_window``; none unsearched)."""


@dataclass(frozen=True, eq=False)
class Planned:
    """A plan decided in this process: the file's contents and the live objects beside them."""

    plan: ElixirPlan
    live: LivePlan


def _count_memory(
    layout: ChunkLayout,
    offload: set[int],
    n_blocks: int,
    dtype: torch.dtype,
    state: AdamState,
    lane: bool,
    window: GradWindow,
) -> tuple[PlanMemory, int]:
    """Bytes per rank by arena, with the search's formula (``search.memory.ArenaBytes``): one count;
    and the device lane's elements per staging buffer (0: no lane)."""
    arenas = ArenaBytes(layout, dtype, state, lane, window)
    on_device = np.array([c.index not in offload for c in layout.chunks], dtype=bool)
    memory = PlanMemory(
        rcache=n_blocks * arenas.buffer,
        private=arenas.private,
        device_shards=int(arenas.device_arena[on_device].sum()),
        device_grads=arenas.grads(on_device),
        lane_staging=arenas.staging(on_device),
        host_shards=arenas.host(on_device),
    )
    return memory, arenas.lane_numel(on_device)


def resolve_plan(
    config: ElixirConfig,
    table: ParamTable,
    layout: ChunkLayout,
    dtype: torch.dtype,
    *,
    search: SearchResult | None = None,
    lane: bool = False,
    batch_shape: tuple[int, int] | None = None,
    profile: ProfileSummary | None = None,
    activations: Where = "device",
) -> Planned:
    """The plan for ``layout`` (built from ``table``), whole: the config's explicit choices, the
    search's for the rest (if it ran, it already honoured the explicit ones), else the static
    defaults (rCache max, nothing offloaded). ``lane``: whether a static plan has the device update
    lane (a searched one has the search's). The rCache holds at once every unit's chunks and, when
    the search profiled them, every checkpointed region's (``ChunkLayout.block_bounds``).
    ``batch_shape``, ``profile``: the example batch's shape and the profile's summary, recorded;
    ``activations``: the search's choice where the config leaves it to the planner."""
    unit_chunks, regions, root = resident_chunks(layout, table, search.regions if search is not None else [])
    resident = {f"unit {u.name!r}": cs for u, cs in zip(table.units, unit_chunks)}
    resident.update({f"checkpointed region {i}": cs for i, cs in enumerate(regions)})
    lo, hi = layout.block_bounds(resident.values())
    n = len(layout.chunks)
    n_blocks = _rcache_blocks(config, resident, lo, hi, search)
    if config.offload is not None:
        offload = offloaded_chunks(config.offload, n, layout.chunk_size)
    else:
        offload = search.placement.offload if search is not None else []

    window = search.grad_window if search is not None else GradWindow()
    lane = search.device_lane if search is not None else lane
    memory, lane_numel = _count_memory(layout, set(offload), n_blocks, dtype, config.state, lane, window)
    if search is not None:
        memory = replace(memory, activations=int(search.budget.activations), buffers=int(search.budget.buffers))
    if config.activations != "auto":
        activations = config.activations
    if activations == "host" and profile is not None:
        memory = replace(memory, host_activations=profile.held_inputs)
    plan = ElixirPlan(
        chunk_size=layout.chunk_size,
        n_blocks=n_blocks,
        offload=tuple(offload),
        n_chunks=n,
        world_size=layout.world_size,
        dtype=str(dtype).removeprefix("torch."),
        moments=config.moments,
        activations=activations,
        min_blocks=lo,
        max_blocks=hi,
        device_lane=lane_numel,
        memory=memory,
        predicted=search.placement.time if search is not None else None,
        budget=search.budget if search is not None else None,
        search=search.report if search is not None else None,
        alternatives=search.alternatives if search is not None else (),
        gpu_memory=config.gpu_memory_bytes,
        batch_shape=batch_shape,
        profile=profile,
        chunks=tuple(
            PlannedChunk(c.numel, c.private, c.trainable, tuple(layout.names[s.param][0] for s in c.slots))
            for c in layout.chunks
        ),
    )
    live = LivePlan(table, layout, tuple(unit_chunks), root, window)
    return Planned(plan, live)


def _rcache_blocks(
    config: ElixirConfig, resident: dict[str, tuple[int, ...]], lo: int, hi: int, search: SearchResult | None
) -> int:
    """``config.n_blocks`` within the bounds, else the search's choice, else ``hi``."""
    if isinstance(config.n_blocks, int):
        if config.n_blocks < lo:
            biggest = max(resident, key=lambda k: len(resident[k]))
            raise PlanError(
                f"rCache of {config.n_blocks} blocks is smaller than {biggest}, whose parameters span "
                f"{lo} chunks that must be resident together (a checkpointed region is recomputed as a whole): "
                f"use n_blocks >= {lo}, or a larger chunk_size"
            )
        return min(config.n_blocks, hi)
    if config.n_blocks == "min":
        return lo
    if config.n_blocks == "max" or search is None:
        return hi
    return min(max(search.placement.n_blocks, lo), hi)


def check_fits(plan: ElixirPlan, device: torch.device, host: HostMemory) -> None:
    """Fails before allocation when the plan exceeds the device's memory or the host's as the run
    will have it (``planner.job_host_memory``)."""
    gib = 2**30
    if device.type == "cuda":
        capacity, limit = device_capacity(device), process_limit(device)
        if plan.device_bytes > capacity:
            total = torch.cuda.mem_get_info(device)[1]
            capped = (
                ""
                if limit is None
                else (
                    f" within this process's limit of {limit / gib:.2f} GiB (ElixirConfig.gpu_memory or "
                    "torch.cuda.set_per_process_memory_fraction; or raise it)"
                )
            )
            raise PlanError(
                f"the plan needs {plan.device_bytes / gib:.2f} GiB of GPU memory per rank for model states and "
                f"rCache, but only {capacity / gib:.2f} of {total / gib:.2f} GiB are free{capped}: offload more "
                "chunks, use fewer rCache blocks, or more GPUs"
            )
    if plan.host_bytes * host.ranks > host.capacity:
        raise PlanError(
            f"the plan needs {plan.host_bytes / gib:.2f} GiB of host memory per rank x {host.ranks} ranks on this host "
            f"for offloaded chunks and held block inputs ({(plan.memory.host_activations or 0) / gib:.2f} GiB), but the host "
            f"has {host.accounting()}: offload fewer chunks, keep activations on the GPU, or use more hosts"
        )
