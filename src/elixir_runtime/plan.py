"""``ElixirPlan``: chunk size, rCache size and where each chunk's shard lives, with its cost.

The planner (``planner.py``) decides a plan before any training memory is allocated; this module
holds what a plan is and its rules: the rCache bounds, the user's explicit choices (``n_blocks``,
``offload``), the memory count and whether it fits this machine (``PlanError`` with the numbers).
A searched plan also carries the predicted step time, the budget and the rigid alternatives it was
compared with. The JSON file holds the decided values; the layout and table it was decided on are
this process's objects and stay out of it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .chunk.layout import ChunkLayout
from .config import ElixirConfig, PlanError
from .gpu_limit import device_capacity, process_limit
from .host import GIB, HostMemory
from .profiler.profile import ModelProfile
from .runtime.device_lane import LANE_DEPTH
from .search.budget import Budget
from .search.loop import SearchResult, resident_chunks
from .search.memory import ArenaBytes, GradWindow
from .search.placement import offloaded_chunks
from .search.step_time import StepTime
from .units import ParamTable

__all__ = ["DEVICE_MEMORY", "ElixirPlan", "PlanMemory", "resolve_plan", "check_fits", "format_step_time"]

DEVICE_MEMORY = ("rcache", "private", "device_shards", "device_grads", "lane_staging")
"""The fields of ``PlanMemory`` that are GPU memory per rank for model states and rCache: what
``device_bytes`` sums and the budget's ``U_allowed`` bounds (activations and buffers come on top)."""


@dataclass
class PlanMemory:
    """Predicted bytes per rank by arena, with the search's formula (``search.memory.ArenaBytes``)."""

    rcache: int = 0
    private: int = 0
    device_shards: int = 0
    device_grads: int = 0
    """The GPU's gradient shards beyond the activations freed under them (``ArenaBytes.grads``)."""
    lane_staging: int = 0
    host_shards: int = 0
    activations: int | None = None
    """The profiled activation peak; ``None``: not searched."""
    buffers: int | None = None
    """The model's buffers; ``None``: not searched."""

    @property
    def device(self) -> int:
        return sum(getattr(self, k) for k in DEVICE_MEMORY)

    def to_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> PlanMemory:
        return cls(**data)


def _runtime(default: Any = None, factory: Any = None) -> Any:
    """A field of this process's objects: not in the file, not compared."""
    kw = {"default_factory": factory} if factory is not None else {"default": default}
    return field(repr=False, compare=False, metadata={"runtime": True}, **kw)


@dataclass
class ElixirPlan:
    """What the engine runs: the decided values (the JSON file, ``to_json``/``from_json``), and, on a
    plan the planner returned, the objects they were decided on (runtime fields: not in the file,
    not compared; ``None`` on a plan read from a file, which drives ``prepare`` as a static config)."""

    chunk_size: int
    n_blocks: int
    offload: list[int]
    """Indices of chunks whose shard and optimizer state live in host memory."""
    n_chunks: int
    world_size: int
    dtype: str
    min_blocks: int
    max_blocks: int
    device_lane: int = 0
    """Elements per staging buffer of the device update lane (``runtime/device_lane.py``): the GPU
    updates slices of offloaded chunks beside the CPU; 0: the CPU alone (nothing offloaded, or
    ``ElixirConfig.device_assisted_update`` off)."""
    memory: PlanMemory = field(default_factory=PlanMemory)
    predicted: StepTime | None = None
    """Predicted seconds per optimizer step and its parts; ``None`` when the plan was not searched."""
    budget: Budget | None = None
    """The memory budget the search respected; ``None`` when the plan was not searched."""
    search: dict[str, Any] = field(default_factory=dict)
    """Why this plan: the chunk sizes simulated, I(n)/J(n) at the choice, hardware, timings."""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    """Rigid plans of the same layout (ZeRO-2/3-like offload-all, rCache max/min) with their
    predicted memory and step time."""
    gpu_memory: int | None = None
    """``ElixirConfig.gpu_memory`` the plan was made under (bytes per GPU; ``None``: no cap); a run
    from this plan file is held to it again."""
    batch_shape: list[int] | None = None
    """``[batch, seq]`` of the example batch the plan was made with (its activations are the ones
    budgeted); a larger training batch warns once (``runtime/batch_guard.py``). ``None``: no batch
    (and plan files from before it was recorded)."""

    param_table: ParamTable | None = _runtime()
    """The parameters in first-use order the layout was built from (``None``: a plan read from a file)."""
    layout: ChunkLayout | None = _runtime()
    unit_chunks: list[tuple[int, ...]] = _runtime(factory=list)
    """The chunks each unit's hooks acquire (``param_table.units`` order)."""
    root_chunks: tuple[int, ...] = _runtime(default=())
    """The (private) chunks of the parameters read outside their module's call (``ParamTable.resident``),
    which the model's own forward acquires before anything else runs."""
    grad_window: GradWindow = _runtime(factory=GradWindow)
    """What the GPU's gradient shards share memory with (``search.memory.grad_window``; none unsearched)."""
    profile: ModelProfile | None = _runtime()
    """The profiled step the search planned from (on the rank that searched)."""

    def placement(self) -> list[str]:
        off = set(self.offload)
        return ["host" if i in off else "device" for i in range(self.n_chunks)]

    @property
    def device_bytes(self) -> int:
        return self.memory.device

    @property
    def host_bytes(self) -> int:
        return self.memory.host_shards

    @property
    def predicted_step_s(self) -> float | None:
        """Predicted seconds per optimizer step; ``None`` when the plan was not searched."""
        return None if self.predicted is None else float(self.predicted.total)

    @property
    def device_peak_bytes(self) -> int:
        """Model states and rCache plus the profiled activation peak and buffers."""
        return self.device_bytes + (self.memory.activations or 0) + (self.memory.buffers or 0)

    def table(self, verbose: bool = False) -> str:
        """The plan in rows of plain words (printed by the HF integration when it builds the engine);
        ``verbose`` adds the search's I(n)/J(n) at the choice (``elixir-plan --verbose``)."""
        gib = 2**30
        own = "; tied or oversize parameters get chunks of their own" if self.memory.private else ""
        rows = [
            ("chunks", f"{self.n_chunks} of at most {self.chunk_size:,} elements ({self.dtype}){own}"),
            (
                "gathered-parameter cache",
                f"{self.n_blocks} blocks (rCache; at least {self.min_blocks}, at most {self.max_blocks} useful)",
            ),
        ]
        if self.memory.private:
            rows.append(
                (
                    "own-chunk buffers",
                    f"{self.memory.private / gib:.3f} GiB (tied parameters and those larger "
                    "than a chunk, or read outside their module: kept gathered)",
                )
            )
        rows += [
            ("offloaded chunks", f"{len(self.offload)} of {self.n_chunks}"),
            ("world size", str(self.world_size)),
        ]
        if self.batch_shape:
            b, s = self.batch_shape
            rows.append(("planned batch", f"{b} x {s} tokens per micro-batch (a larger training batch warns)"))
        rows += [
            ("GPU memory / rank", f"{self.device_bytes / gib:.3f} GiB (model states + gathered-parameter cache)"),
            ("host memory / rank", f"{self.host_bytes / gib:.3f} GiB (pinned)"),
            (
                "device update lane",
                f"on: {LANE_DEPTH} x {self.device_lane:,} elements staged ({self.memory.lane_staging / gib:.3f} GiB)"
                if self.device_lane
                else "off (CPU alone)"
                if self.offload
                else "- (nothing offloaded)",
            ),
        ]
        if self.memory.activations is not None:
            rows.append(
                (
                    "GPU peak / rank",
                    f"{self.device_peak_bytes / gib:.3f} GiB (+ activations "
                    f"{self.memory.activations / gib:.3f}, buffers {(self.memory.buffers or 0) / gib:.3f})",
                )
            )
        if self.gpu_memory is not None:
            rows.append(("GPU memory cap", f"{self.gpu_memory / gib:.3f} GiB per GPU (ElixirConfig.gpu_memory)"))
        if self.budget is not None:
            rows.append(
                (
                    "budget / rank",
                    f"{self.budget.allowed / gib:.3f} GiB GPU for model states and cache, "
                    f"{self.budget.host_allowed / gib:.3f} GiB pinned host",
                )
            )
        if self.predicted is not None:
            rows.append(("predicted step", format_step_time(self.predicted)))
        if self.search.get("rates"):
            r = self.search["rates"]
            cpu = f" ({r['cpu_adam_alone_Gps']} alone)" if r.get("cpu_adam_alone_Gps") else ""
            if r.get("cpu_update_observed_Gps"):
                cpu += f" ({r['cpu_update_observed_Gps']} in a run here)"
            rows.append(
                (
                    "rates / rank",
                    f"H2D {r['h2d_GBps']} / D2H {r['d2h_GBps']} GB/s, collectives "
                    f"{r['busbw_GBps'] or '-'} GB/s, Adam GPU {r['gpu_adam_Gps']} / CPU {r['cpu_adam_Gps']}{cpu} G params/s"
                    + (f" ({r['cpu_threads']} threads)" if r.get("cpu_threads") else ""),
                )
            )
        if verbose and "i_per_gib" in self.search:
            i, j = (
                ("-" if v is None else f"{v * 1e3:.2f}") for v in (self.search["i_per_gib"], self.search["j_per_gib"])
            )
            rows.append(
                (
                    "I(n) / J(n)",
                    f"{i} / {j} ms per GiB saved by one more rCache block / by the next upload (- : none left)",
                )
            )
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_dict(self) -> dict[str, Any]:
        """The file's fields (the runtime ones left out); ``predicted``/``budget`` are ``{}`` when not searched."""
        out = {f.name: getattr(self, f.name) for f in _file_fields()}
        out["memory"] = self.memory.to_dict()
        out["predicted"] = {} if self.predicted is None else self.predicted.to_dict()
        out["budget"] = {} if self.budget is None else self.budget.to_dict()
        return out

    def to_json(self) -> str:
        """``to_dict`` plus ``predicted_step_s`` for readers of the file (derived: ignored on load)."""
        return json.dumps({**self.to_dict(), "predicted_step_s": self.predicted_step_s}, indent=2)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ElixirPlan:
        """A JSON text or the path of a file holding one (plans from before the search included)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ElixirPlan:
        """The plan a saved ``to_json`` document describes: the one plan reader (``elixir_hf``'s plan
        files too). Unknown keys are an error naming them; ``predicted_step_s`` is derived, ignored."""
        data = {k: v for k, v in data.items() if k != "predicted_step_s"}
        known = {f.name for f in _file_fields()}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"not an ElixirPlan: unknown keys {unknown}; a plan has {sorted(known)}")
        memory, predicted, budget = data.pop("memory", {}), data.pop("predicted", {}), data.pop("budget", {})
        return cls(
            **data,
            memory=PlanMemory.from_dict(memory),
            predicted=StepTime.from_dict(predicted) if predicted else None,
            budget=Budget.from_dict(budget) if budget else None,
        )


def _file_fields() -> list:
    return [f for f in fields(ElixirPlan) if not f.metadata.get("runtime")]


def format_step_time(t: StepTime) -> str:
    """``1.234 s (compute 1.0, exposed transfers 0.1, GPU Adam 0.1, exposed CPU Adam 0.0; moved: ...)``."""
    coll = "not measured" if t.collectives is None else f"{t.collectives:.3f}"
    return (
        f"{t.total:.3f} s (compute {t.compute:.3f}, exposed transfers {t.exposed_transfers:.3f}, "
        f"GPU Adam {t.gpu_adam:.3f}, exposed CPU Adam {t.exposed_cpu_adam:.3f}; moved: H2D {t.h2d:.3f}, "
        f"D2H {t.d2h:.3f}, collectives {coll}, CPU Adam {t.cpu_adam:.3f}"
        + (f", device lane Adam {t.device_lane_adam:.3f}" if t.device_lane_adam else "")
        + ")"
    )


def _count_memory(
    layout: ChunkLayout, offload: set[int], n_blocks: int, dtype: torch.dtype, lane: bool, window: GradWindow
) -> tuple[PlanMemory, int]:
    """Bytes per rank by arena, with the search's formula (``search.memory.ArenaBytes``): one count;
    and the device lane's elements per staging buffer (0: no lane)."""
    arenas = ArenaBytes(layout, dtype, lane, window)
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
) -> ElixirPlan:
    """The plan for ``layout`` (built from ``table``): the config's explicit choices, the search's for
        the rest (if it ran, it already honoured the explicit ones), else the static defaults (rCache max,
        nothing offloaded). ``lane``: whether a static plan has the device update lane (a searched one has
    the search's). The rCache holds at once
        every unit's chunks and, when the search profiled them, every checkpointed region's
        (``ChunkLayout.block_bounds``)."""
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
    memory, lane_numel = _count_memory(layout, set(offload), n_blocks, dtype, lane, window)
    plan = ElixirPlan(
        chunk_size=layout.chunk_size,
        n_blocks=n_blocks,
        offload=offload,
        n_chunks=n,
        world_size=layout.world_size,
        dtype=str(dtype).removeprefix("torch."),
        min_blocks=lo,
        max_blocks=hi,
        device_lane=lane_numel,
        memory=memory,
        gpu_memory=config.gpu_memory,
        param_table=table,
        layout=layout,
        unit_chunks=unit_chunks,
        root_chunks=root,
        grad_window=window,
    )
    if search is not None:
        _attach_search(plan, search)
    return plan


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


def _attach_search(plan: ElixirPlan, search: SearchResult) -> None:
    plan.memory.activations = int(search.budget.activations)
    plan.memory.buffers = int(search.budget.buffers)
    chosen = search.placement
    plan.predicted = chosen.time
    plan.budget = search.budget
    plan.search = {
        "i_per_gib": chosen.i_per_byte * GIB if math.isfinite(chosen.i_per_byte) else None,
        "j_per_gib": chosen.j_per_byte * GIB if math.isfinite(chosen.j_per_byte) else None,
        "candidates": search.candidates,
        "notes": search.notes,
        "seconds": search.seconds,
        "rates": search.rates,
        "hardware": search.hardware,
    }
    plan.alternatives = search.alternatives


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
            f"for offloaded chunks, but the host has {host.accounting()}: offload fewer chunks or use more hosts"
        )
