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
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .chunk.layout import ChunkLayout
from .config import ElixirConfig
from .units import Unit

if TYPE_CHECKING:
    from .search.loop import SearchResult

__all__ = ["ElixirPlan", "resolve_plan", "PlanError"]


class PlanError(ValueError):
    """The requested plan cannot run; the message names the numbers and the fix."""


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
    memory: dict[str, int] = field(default_factory=dict)
    """Predicted bytes per rank: ``rcache``, ``private``, ``device_shards``, ``host_shards``; from the
    search also ``activations`` (the profiled peak) and ``buffers``."""
    predicted: dict[str, float | None] = field(default_factory=dict)
    """Predicted seconds per optimizer step and its parts (``search.cost.StepTime``); empty when
    the plan was not searched."""
    budget: dict[str, float] = field(default_factory=dict)
    """The memory budget the search respected (``search.budget.Budget``)."""
    search: dict[str, Any] = field(default_factory=dict)
    """Why this plan: the chunk sizes simulated, I(n)/J(n) at the choice, hardware, timings."""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    """Rigid plans of the same layout (ZeRO-2/3-like offload-all, rCache max/min) with their
    predicted memory and step time."""

    def placement(self) -> list[str]:
        off = set(self.offload)
        return ["host" if i in off else "device" for i in range(self.n_chunks)]

    @property
    def device_bytes(self) -> int:
        return self.memory.get("rcache", 0) + self.memory.get("private", 0) + self.memory.get("device_shards", 0)

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
            ("chunks", f"{self.n_chunks} x {self.chunk_size:,} elements ({self.dtype})"),
            ("rCache blocks", f"{self.n_blocks} (min {self.min_blocks}, max {self.max_blocks})"),
            ("offloaded chunks", f"{len(self.offload)} of {self.n_chunks}"),
            ("world size", str(self.world_size)),
            ("device memory / rank", f"{self.device_bytes / gib:.3f} GiB (model states + rCache)"),
            ("host memory / rank", f"{self.host_bytes / gib:.3f} GiB (pinned)"),
        ]
        if "activations" in self.memory:
            rows.append(("device peak / rank", f"{self.device_peak_bytes / gib:.3f} GiB (+ activations "
                         f"{self.memory['activations'] / gib:.3f}, buffers {self.memory.get('buffers', 0) / gib:.3f})"))
        if self.budget:
            rows.append(("budget / rank", f"{self.budget['allowed'] / gib:.3f} GiB GPU (U_allowed), "
                         f"{self.budget['host_allowed'] / gib:.3f} GiB host"))
        if self.predicted:
            rows.append(("predicted step", format_step_time(self.predicted)))
        if self.search.get("rates"):
            r = self.search["rates"]
            alone = f" ({r['cpu_adam_alone_Gps']} alone)" if r.get("cpu_adam_alone_Gps") else ""
            rows.append(("rates / rank", f"H2D {r['h2d_GBps']} / D2H {r['d2h_GBps']} GB/s, collectives "
                         f"{r['busbw_GBps'] or '-'} GB/s, Adam GPU {r['gpu_adam_Gps']} / CPU {r['cpu_adam_Gps']}{alone} G params/s"))
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
        data = json.loads(text)
        data.pop("predicted_step_s", None)
        return cls(**data)


def format_step_time(t: dict[str, float | None]) -> str:
    """``1.234 s = compute 1.0 + exposed transfers 0.1 + exposed CPU Adam 0.0 + GPU Adam 0.1`` etc."""
    coll = "not measured" if t.get("collectives") is None else f"{t['collectives']:.3f}"
    return (
        f"{t['total']:.3f} s (compute {t['compute']:.3f}, exposed transfers {t['exposed_transfers']:.3f}, "
        f"GPU Adam {t['gpu_adam']:.3f}, exposed CPU Adam {t['exposed_cpu_adam']:.3f}; moved: H2D {t['h2d']:.3f}, "
        f"D2H {t['d2h']:.3f}, collectives {coll}, CPU Adam {t['cpu_adam']:.3f})"
    )


def _count_memory(layout: ChunkLayout, offload: set[int], n_blocks: int, dtype: torch.dtype) -> dict[str, int]:
    elt = torch.empty((), dtype=dtype).element_size()
    state = elt + 8 + (0 if dtype == torch.float32 else 4)  # grad, m, v, fp32 master (aliased in fp32 runs)
    mem = {"rcache": n_blocks * layout.chunk_size * elt, "private": 0, "device_shards": 0, "host_shards": 0}
    for c in layout.chunks:
        shard = layout.shard_numel(c)
        per = shard * (elt + (state if c.trainable else 0))
        mem["host_shards" if c.index in offload else "device_shards"] += per
        if c.private:
            mem["private"] += c.numel * elt
    return mem


def block_bounds(layout: ChunkLayout, units: Sequence[Unit]) -> tuple[int, int]:
    """(min, max) useful rCache blocks: the largest unit's public chunks .. all public chunks."""
    public = {c.index for c in layout.chunks if not c.private}
    need = max((len(public.intersection(u.chunks)) for u in units), default=0)
    return need, len(public)


def resolve_plan(
    config: ElixirConfig,
    layout: ChunkLayout,
    units: Sequence[Unit],
    device: torch.device,
    dtype: torch.dtype,
    search: "SearchResult | None" = None,
    *,
    check: bool = True,
) -> ElixirPlan:
    """The plan for ``layout``: the config's explicit choices, the search's for the rest (if it ran,
    it already honoured the explicit ones), else the static defaults (rCache max, nothing offloaded).
    ``check=False`` skips comparing it with this machine's free memory (planning for another one)."""
    lo, hi = block_bounds(layout, units)
    n = len(layout.chunks)
    if isinstance(config.n_blocks, int):
        if config.n_blocks < lo:
            biggest = max(units, key=lambda u: len(u.chunks))
            raise PlanError(
                f"rCache of {config.n_blocks} blocks is smaller than unit {biggest.name!r}, whose parameters span "
                f"{lo} chunks that must be resident together (a checkpointed region is recomputed as a whole): "
                f"use n_blocks >= {lo}, or a larger chunk_size"
            )
        n_blocks = min(config.n_blocks, hi)
    elif config.n_blocks == "min":
        n_blocks = lo
    elif config.n_blocks == "max" or search is None:
        n_blocks = hi
    else:
        n_blocks = min(max(search.n_blocks, lo), hi)

    if isinstance(config.offload, (float, int)) and not isinstance(config.offload, bool):
        k = round(float(config.offload) * n)
        offload = list(range(n - k, n))
    elif config.offload is not None:
        offload = sorted(set(int(i) for i in config.offload))
        bad = [i for i in offload if not 0 <= i < n]
        if bad:
            raise PlanError(f"offload names chunks {bad}, but the layout has chunks 0..{n - 1}")
    else:
        offload = list(search.offload) if search is not None else []

    memory = _count_memory(layout, set(offload), n_blocks, dtype)
    plan = ElixirPlan(
        chunk_size=layout.chunk_size,
        n_blocks=n_blocks,
        offload=offload,
        n_chunks=n,
        world_size=layout.world_size,
        dtype=str(dtype).removeprefix("torch."),
        min_blocks=lo,
        max_blocks=hi,
        memory=memory,
    )
    if search is not None:
        _attach_search(plan, search)
    if check:
        check_fits(plan, device)
    return plan


def _attach_search(plan: ElixirPlan, search: "SearchResult") -> None:
    plan.memory["activations"] = int(search.budget.activations)
    plan.memory["buffers"] = int(search.budget.buffers)
    plan.predicted = search.time.as_dict()
    plan.budget = search.budget.as_dict()
    plan.search = {
        "i_per_gib": search.i_per_gib if math.isfinite(search.i_per_gib) else None,
        "j_per_gib": search.j_per_gib if math.isfinite(search.j_per_gib) else None,
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
        free, total = torch.cuda.mem_get_info(device)
        if plan.device_bytes > free:
            raise PlanError(
                f"the plan needs {plan.device_bytes / gib:.2f} GiB of GPU memory per rank for model states and "
                f"rCache, but only {free / gib:.2f} of {total / gib:.2f} GiB are free: offload more chunks, use fewer "
                "rCache blocks, or more GPUs"
            )
    available = _host_available()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if available is not None and plan.host_bytes * ranks_here > available:
        raise PlanError(
            f"the plan needs {plan.host_bytes / gib:.2f} GiB of host memory per rank x {ranks_here} ranks on this host "
            f"for offloaded chunks, but only {available / gib:.2f} GiB are available: offload fewer chunks or use "
            "more hosts"
        )


def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
