"""``ElixirPlan``: chunk size, rCache size and where each chunk's shard lives, with its memory cost.

A plan is resolved from the config and the chunk layout before any training memory is allocated,
so an impossible plan fails early with the numbers. ``mode="auto"`` uses a simple greedy rule
until the search engine (profiler + cost model) provides one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .chunk.layout import ChunkLayout
from .config import ElixirConfig
from .runtime.units import Unit

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
    """Predicted bytes per rank: ``rcache``, ``private``, ``device_shards``, ``host_shards``."""

    def placement(self) -> list[str]:
        off = set(self.offload)
        return ["host" if i in off else "device" for i in range(self.n_chunks)]

    @property
    def device_bytes(self) -> int:
        return self.memory.get("rcache", 0) + self.memory.get("private", 0) + self.memory.get("device_shards", 0)

    @property
    def host_bytes(self) -> int:
        return self.memory.get("host_shards", 0)

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
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ElixirPlan":
        text = Path(text_or_path).read_text() if Path(str(text_or_path)).exists() else str(text_or_path)
        return cls(**json.loads(text))


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
    config: ElixirConfig, layout: ChunkLayout, units: Sequence[Unit], device: torch.device, dtype: torch.dtype
) -> ElixirPlan:
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
    elif config.n_blocks == "max" or config.mode == "static" or device.type != "cuda":
        n_blocks = hi
    else:
        n_blocks = None  # auto, below

    if isinstance(config.offload, (float, int)) and not isinstance(config.offload, bool):
        k = round(float(config.offload) * n)
        offload = list(range(n - k, n))
    elif config.offload is not None:
        offload = sorted(set(int(i) for i in config.offload))
        bad = [i for i in offload if not 0 <= i < n]
        if bad:
            raise PlanError(f"offload names chunks {bad}, but the layout has chunks 0..{n - 1}")
    else:
        offload = None

    if n_blocks is None or offload is None:
        n_blocks, offload = _auto(layout, lo, hi, n_blocks, offload, device, dtype, config.prefetch)
    plan = ElixirPlan(
        chunk_size=layout.chunk_size,
        n_blocks=n_blocks,
        offload=offload,
        n_chunks=n,
        world_size=layout.world_size,
        dtype=str(dtype).removeprefix("torch."),
        min_blocks=lo,
        max_blocks=hi,
        memory=_count_memory(layout, set(offload), n_blocks, dtype),
    )
    check_fits(plan, device)
    return plan


def _auto(layout, lo, hi, n_blocks, offload, device, dtype, prefetch) -> tuple[int, list[int]]:
    """Greedy stand-in for the search: keep chunks resident from the front while 60 % of the free
    device memory lasts (activations need the rest), then spend what is left on rCache blocks."""
    n = len(layout.chunks)
    if device.type != "cuda":
        return (hi if n_blocks is None else n_blocks), ([] if offload is None else offload)
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(0.6 * free)
    blocks = n_blocks if n_blocks is not None else min(hi, lo + prefetch)
    def device_bytes(offloaded: set[int], n_blocks: int) -> int:
        mem = _count_memory(layout, offloaded, n_blocks, dtype)
        return mem["rcache"] + mem["private"] + mem["device_shards"]

    if offload is None:
        resident = 0
        while resident < n and device_bytes(set(range(resident + 1, n)), blocks) <= budget:
            resident += 1
        offload = list(range(resident, n))
    if n_blocks is None:
        while blocks < hi and device_bytes(set(offload), blocks + 1) <= budget:
            blocks += 1
    return blocks, offload


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
