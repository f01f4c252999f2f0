"""``ElixirPlan``: chunk size, rCache size and where each chunk's shard lives, with its cost.

A plan is resolved from the config and the chunk layout before any training memory is allocated,
so an impossible plan fails early with the numbers. With ``mode="auto"`` on a GPU the search
(``elixir_runtime.search``) has chosen the chunk size, the rCache size and the offloaded chunks
from a profile of the step and of the machine; the plan then also carries the predicted memory,
the predicted step time and the rigid alternatives it was compared with.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .chunk.layout import ChunkLayout, build_layout
from .config import ElixirConfig, PlanError, device_lane_wanted, offloaded_chunks
from .gpu_limit import device_capacity, process_limit
from .host import host_available, local_ranks
from .search.loop import GIB, SearchResult
from .runtime.device_lane import LANE_DEPTH
from .search.memory import ArenaBytes, GradWindow
from .units import ParamTable

__all__ = ["DEVICE_MEMORY", "ElixirPlan", "plan_model", "resolve_plan"]

DEVICE_MEMORY = ("rcache", "private", "device_shards", "device_grads", "lane_staging")
"""The keys of ``ElixirPlan.memory`` that are GPU memory per rank for model states and rCache: what
``device_bytes`` sums and the budget's ``U_allowed`` bounds (activations and buffers come on top)."""


@dataclass
class ElixirPlan:
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
    memory: dict[str, int] = field(default_factory=dict)
    """Predicted bytes per rank: ``rcache``, ``private``, ``device_shards``, ``device_grads`` (the
    GPU's gradient shards beyond the activations freed under them, ``search.memory.ArenaBytes.grads``),
    ``lane_staging``, ``host_shards``; from the search also ``activations`` (the profiled peak) and
    ``buffers``."""
    predicted: dict[str, float | None] = field(default_factory=dict)
    """Predicted seconds per optimizer step and its parts (``search.step_time.StepTime``); empty when
    the plan was not searched."""
    budget: dict[str, float] = field(default_factory=dict)
    """The memory budget the search respected (``search.budget.Budget``)."""
    search: dict[str, Any] = field(default_factory=dict)
    """Why this plan: the chunk sizes simulated, I(n)/J(n) at the choice, hardware, timings."""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    """Rigid plans of the same layout (ZeRO-2/3-like offload-all, rCache max/min) with their
    predicted memory and step time."""
    gpu_memory: int | None = None
    """``ElixirConfig.gpu_memory`` the plan was made under (bytes per GPU; ``None``: no cap); a run
    from this plan file is held to it again."""

    def placement(self) -> list[str]:
        off = set(self.offload)
        return ["host" if i in off else "device" for i in range(self.n_chunks)]

    @property
    def device_bytes(self) -> int:
        return sum(self.memory.get(k, 0) for k in DEVICE_MEMORY)

    @property
    def host_bytes(self) -> int:
        return self.memory.get("host_shards", 0)

    @property
    def predicted_step_s(self) -> float | None:
        """Predicted seconds per optimizer step (``predicted["total"]``); ``None`` when the plan was
        not searched."""
        total = self.predicted.get("total") if self.predicted else None
        return None if total is None else float(total)

    @property
    def device_peak_bytes(self) -> int:
        """Model states and rCache plus the profiled activation peak and buffers."""
        return self.device_bytes + self.memory.get("activations", 0) + self.memory.get("buffers", 0)

    def table(self) -> str:
        gib = 2**30
        rows = [
            ("chunks", f"{self.n_chunks} of at most {self.chunk_size:,} elements, private ones aside ({self.dtype})"),
            ("rCache blocks", f"{self.n_blocks} (min {self.min_blocks}, max {self.max_blocks})"),
            ("private buffers", f"{self.memory.get('private', 0) / gib:.3f} GiB (tied parameters and those larger "
             "than a chunk: chunks of their own, never evicted)"),
            ("offloaded chunks", f"{len(self.offload)} of {self.n_chunks}"),
            ("world size", str(self.world_size)),
            ("device memory / rank", f"{self.device_bytes / gib:.3f} GiB (model states + rCache)"),
            ("host memory / rank", f"{self.host_bytes / gib:.3f} GiB (pinned)"),
            ("device update lane", f"on: {LANE_DEPTH} x {self.device_lane:,} elements staged "
             f"({self.memory.get('lane_staging', 0) / gib:.3f} GiB)" if self.device_lane
             else "off (CPU alone)" if self.offload else "- (nothing offloaded)"),
        ]
        if "activations" in self.memory:
            rows.append(("device peak / rank", f"{self.device_peak_bytes / gib:.3f} GiB (+ activations "
                         f"{self.memory['activations'] / gib:.3f}, buffers {self.memory.get('buffers', 0) / gib:.3f})"))
        if self.gpu_memory is not None:
            rows.append(("GPU memory cap", f"{self.gpu_memory / gib:.3f} GiB per GPU (ElixirConfig.gpu_memory)"))
        if self.budget:
            rows.append(("budget / rank", f"{self.budget['allowed'] / gib:.3f} GiB GPU (U_allowed), "
                         f"{self.budget['host_allowed'] / gib:.3f} GiB host"))
        if self.predicted:
            rows.append(("predicted step", format_step_time(self.predicted)))
        if self.search.get("rates"):
            r = self.search["rates"]
            alone = f" ({r['cpu_adam_alone_Gps']} alone)" if r.get("cpu_adam_alone_Gps") else ""
            rows.append(("rates / rank", f"H2D {r['h2d_GBps']} / D2H {r['d2h_GBps']} GB/s, collectives "
                         f"{r['busbw_GBps'] or '-'} GB/s, Adam GPU {r['gpu_adam_Gps']} / CPU {r['cpu_adam_Gps']}{alone} G params/s"
                         + (f" ({r['cpu_threads']} threads)" if r.get("cpu_threads") else "")))
        if "i_per_gib" in self.search:
            i, j = (("-" if v is None else f"{v * 1e3:.2f}") for v in (self.search["i_per_gib"], self.search["j_per_gib"]))
            rows.append(("I(n) / J(n)", f"{i} / {j} ms per GiB saved by one more rCache block / by the next upload "
                         "(- : none left)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_json(self) -> str:
        """The fields, plus ``predicted_step_s`` for readers of the file (derived: ignored on load)."""
        return json.dumps({**asdict(self), "predicted_step_s": self.predicted_step_s}, indent=2)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ElixirPlan":
        """A JSON text or the path of a file holding one (plans from before the search included)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ElixirPlan":
        """The plan a saved ``to_json`` document describes: the one plan reader (``elixir_hf``'s plan
        files too). Unknown keys are an error naming them; ``predicted_step_s`` is derived, ignored."""
        data = {k: v for k, v in data.items() if k != "predicted_step_s"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"not an ElixirPlan: unknown keys {unknown}; a plan has {sorted(known)}")
        return cls(**data)


def format_step_time(t: dict[str, float | None]) -> str:
    """``1.234 s = compute 1.0 + exposed transfers 0.1 + exposed CPU Adam 0.0 + GPU Adam 0.1`` etc."""
    coll = "not measured" if t.get("collectives") is None else f"{t['collectives']:.3f}"
    return (
        f"{t['total']:.3f} s (compute {t['compute']:.3f}, exposed transfers {t['exposed_transfers']:.3f}, "
        f"GPU Adam {t['gpu_adam']:.3f}, exposed CPU Adam {t['exposed_cpu_adam']:.3f}; moved: H2D {t['h2d']:.3f}, "
        f"D2H {t['d2h']:.3f}, collectives {coll}, CPU Adam {t['cpu_adam']:.3f}"
        + (f", device lane Adam {t['device_lane_adam']:.3f}" if t.get("device_lane_adam") else "") + ")"
    )


def _count_memory(
    layout: ChunkLayout, offload: set[int], n_blocks: int, dtype: torch.dtype, lane: bool, window: GradWindow
) -> tuple[dict[str, int], int]:
    """Bytes per rank by arena, with the search's formula (``search.memory.ArenaBytes``): one count;
    and the device lane's elements per staging buffer (0: no lane)."""
    arenas = ArenaBytes(layout, dtype, lane, window)
    on_device = np.array([c.index not in offload for c in layout.chunks], dtype=bool)
    memory = {
        "rcache": n_blocks * arenas.buffer,
        "private": arenas.private,
        "device_shards": int(arenas.device_arena[on_device].sum()),
        "device_grads": arenas.grads(on_device),
        "lane_staging": arenas.staging(on_device),
        "host_shards": arenas.host(on_device),
    }
    return memory, arenas.lane_numel(on_device)


def plan_model(
    table: ParamTable,
    config: ElixirConfig,
    *,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    search: SearchResult | None = None,
    check: bool = True,
) -> tuple[ChunkLayout, list[tuple[int, ...]], ElixirPlan]:
    """Parameter table → ``build_layout`` → chunks of every unit → ``resolve_plan``: the one way
    ``prepare``, ``elixir-plan`` and the tests go from a (searched) table to the layout, the chunks
    each unit's hooks acquire, and the plan. The chunk size is the search's if it ran, else the config's."""
    layout = build_layout(
        table.params,
        table.names,
        table.groups,
        table.private,
        world_size=world_size,
        chunk_size=config.chunk_size if search is None else search.chunk_size,
        alignment=config.alignment,
    )
    unit_chunks = [layout.chunks_of(table.index[id(p)] for p in u.params) for u in table.units]
    resident = {f"unit {u.name!r}": cs for u, cs in zip(table.units, unit_chunks)}
    for i, names in enumerate(search.regions if search is not None else ()):
        resident[f"checkpointed region {i}"] = layout.chunks_of(table.by_name[n] for n in names if n in table.by_name)
    plan = resolve_plan(config, layout, resident, device, dtype, search, check=check)
    return layout, unit_chunks, plan


def resolve_plan(
    config: ElixirConfig,
    layout: ChunkLayout,
    resident: dict[str, Sequence[int]],
    device: torch.device,
    dtype: torch.dtype,
    search: SearchResult | None = None,
    *,
    check: bool = True,
) -> ElixirPlan:
    """The plan for ``layout``: the config's explicit choices, the search's for the rest (if it ran,
    it already honoured the explicit ones), else the static defaults (rCache max, nothing offloaded).
    ``resident``: the chunk sets that must be in the rCache at once, by what needs them (units,
    checkpointed regions: ``ChunkLayout.block_bounds``). ``check=False`` skips comparing the plan
    with this machine's free memory (planning for another one)."""
    lo, hi = layout.block_bounds(resident.values())
    n = len(layout.chunks)
    if isinstance(config.n_blocks, int):
        if config.n_blocks < lo:
            biggest = max(resident, key=lambda k: len(resident[k]))
            raise PlanError(
                f"rCache of {config.n_blocks} blocks is smaller than {biggest}, whose parameters span "
                f"{lo} chunks that must be resident together (a checkpointed region is recomputed as a whole): "
                f"use n_blocks >= {lo}, or a larger chunk_size"
            )
        n_blocks = min(config.n_blocks, hi)
    elif config.n_blocks == "min":
        n_blocks = lo
    elif config.n_blocks == "max" or search is None:
        n_blocks = hi
    else:
        n_blocks = min(max(search.placement.n_blocks, lo), hi)

    if config.offload is not None:
        offload = offloaded_chunks(config.offload, n, layout.chunk_size)
    else:
        offload = search.placement.offload if search is not None else []

    lane = search.device_lane if search is not None else device_lane_wanted(config, device)
    window = search.grad_window if search is not None else GradWindow()
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
    )
    if search is not None:
        _attach_search(plan, search)
    if check:
        check_fits(plan, device)
    return plan


def _attach_search(plan: ElixirPlan, search: SearchResult) -> None:
    plan.memory["activations"] = int(search.budget.activations)
    plan.memory["buffers"] = int(search.budget.buffers)
    chosen = search.placement
    plan.predicted = chosen.time.as_dict()
    plan.budget = search.budget.as_dict()
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


def check_fits(plan: ElixirPlan, device: torch.device) -> None:
    """Fails before allocation when the plan exceeds the device's or the host's memory."""
    gib = 2**30
    if device.type == "cuda":
        capacity, limit = device_capacity(device), process_limit(device)
        if plan.device_bytes > capacity:
            total = torch.cuda.mem_get_info(device)[1]
            capped = "" if limit is None else (
                f" within this process's limit of {limit / gib:.2f} GiB (ElixirConfig.gpu_memory or "
                "torch.cuda.set_per_process_memory_fraction; or raise it)"
            )
            raise PlanError(
                f"the plan needs {plan.device_bytes / gib:.2f} GiB of GPU memory per rank for model states and "
                f"rCache, but only {capacity / gib:.2f} of {total / gib:.2f} GiB are free{capped}: offload more "
                "chunks, use fewer rCache blocks, or more GPUs"
            )
    available, ranks_here = host_available(), local_ranks()
    if plan.host_bytes * ranks_here > available:
        raise PlanError(
            f"the plan needs {plan.host_bytes / gib:.2f} GiB of host memory per rank x {ranks_here} ranks on this host "
            f"for offloaded chunks, but only {available / gib:.2f} GiB are available: offload fewer chunks or use "
            "more hosts"
        )
