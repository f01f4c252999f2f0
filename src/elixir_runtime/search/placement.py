"""Which chunks live on the GPU and how many rCache blocks: the paper's I(n) vs J(n) (§6).

Start from the rCache minimum (the largest unit or checkpointed region) with every chunk
offloaded. Two ways to spend more GPU memory: one more rCache block, saving I per byte (here
simulated: the Belady misses it removes, at what they cost), or uploading the next chunk with its
optimizer state, saving J per byte (its uploads, gradient offload and CPU update, minus its GPU
update). Chunks are uploaded in forward order: the first chunks are also the ones the rCache
cannot keep from forward to backward, and offloading the last ones leaves their CPU updates the
whole next forward to finish in. The greedy path takes the larger saving at each step.

The plan is the point of that path that fits with the shortest serial step (``step_time.py``), with
any memory left over at that point given to rCache blocks. Taking the best point of a path that
does not depend on the budget makes the choice monotone: more memory never offloads more nor
lengthens the serial step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..config import PlanError
from .budget import Budget
from .memory import ArenaBytes
from .step_time import StepModel, StepTime

__all__ = ["Placement", "greedy_path", "best_placement", "offloaded_chunks"]


@dataclass(frozen=True)
class Placement:
    n_blocks: int
    on_device: np.ndarray
    time: StepTime
    device_bytes: int
    host_bytes: int
    i_per_byte: float
    """Time one more rCache block would save, per byte, at this point (the paper's I(n))."""
    j_per_byte: float
    """Time uploading the next offloaded chunk would save, per byte (the paper's J(n))."""

    @property
    def offload(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self.on_device)]


def _mask(k: int, uploaded: int) -> np.ndarray:
    mask = np.zeros(k, dtype=bool)
    mask[:uploaded] = True
    return mask


def _savings(
    model: StepModel,
    mem: ArenaBytes,
    blocks: int,
    uploaded: int,
    max_blocks: int,
    seen: dict[int, np.ndarray] | None = None,
) -> tuple[float, float]:
    """I(n) and J(n) at ``blocks`` and ``uploaded``; ``seen``: ``model.linear_uploaded`` by blocks, kept
    across the calls of one path (each step's point was a neighbour of the one before)."""
    seen = {} if seen is None else seen

    def linear(b: int) -> np.ndarray:
        if b not in seen:
            seen[b] = model.linear_uploaded(b)
        return seen[b]

    here = linear(blocks)[uploaded]
    i = (here - linear(blocks + 1)[uploaded]) / mem.buffer if blocks < max_blocks else -np.inf
    j = (
        (here - linear(blocks)[uploaded + 1]) / max(1, int(mem.device_arena[uploaded]))
        if uploaded < model.k
        else -np.inf
    )
    return float(i), float(j)


def greedy_path(model: StepModel, mem: ArenaBytes, min_blocks: int, max_blocks: int) -> dict[int, int]:
    """``{chunks uploaded: rCache blocks when that many were}`` along the I/J greedy path."""
    blocks, uploaded = min_blocks, 0
    path = {0: blocks}
    seen: dict[int, np.ndarray] = {}
    while blocks < max_blocks or uploaded < model.k:
        i, j = _savings(model, mem, blocks, uploaded, max_blocks, seen)
        if j >= i:
            uploaded += 1
            path[uploaded] = blocks
        else:
            blocks += 1
    return path


# [Note: the best point, priced once]
# The points are ranked by (serial step, step, chunks offloaded), and no two points offload as many
# chunks: the best is the same in any order. A point whose serial step (``StepModel.serial``, at its
# blocks and, where the minimum may be kept, at the minimum) is longer than the best one's so far
# cannot win, so its whole step is not priced; taken from the most uploaded end, most are such.


def best_placement(
    model: StepModel,
    mem: ArenaBytes,
    budget: Budget,
    min_blocks: int,
    max_blocks: int,
    *,
    n_blocks: int | None = None,
    offload: list[int] | None = None,
) -> Placement | None:
    """The fastest fitting point of the greedy path (``None`` if nothing fits); ``n_blocks`` and
    ``offload`` pin those choices when the user made them."""
    if offload is not None:
        fixed = np.ones(model.k, dtype=bool)
        fixed[offload] = False
        options = [(fixed, n_blocks or min_blocks)]
    else:
        path = greedy_path(model, mem, min_blocks, max_blocks)
        options = [(_mask(model.k, u), n_blocks or b) for u, b in path.items()]
    best: Placement | None = None
    for on_device, floor in reversed(options):  # the most uploaded first: the fastest, as a rule (see below)
        if mem.host(on_device) > budget.host_allowed:
            continue
        blocks = n_blocks if n_blocks is not None else _fill(mem, budget, on_device, max_blocks)
        if blocks < floor or mem.device(blocks, on_device) > budget.allowed:
            continue
        at_min_too = n_blocks is None and floor == min_blocks < blocks
        if best is not None and best.time.serial < min(
            model.serial(b, on_device) for b in ((blocks, min_blocks) if at_min_too else (blocks,))
        ):
            continue  # [Note: the best point, priced once]
        time = model.step(blocks, on_device)
        if at_min_too:
            # Beyond the minimum, a block more never predicts a slower step (fewer misses, the
            # same overlaps); the first one past it starts prefetching and so changes how the
            # transfers overlap: keep the minimum if it is faster (monotone in memory).
            at_min = model.step(min_blocks, on_device)
            if at_min.total < time.total:
                blocks, time = min_blocks, at_min
        key = (time.serial, time.total, int((~on_device).sum()))
        if best is None or key < (best.time.serial, best.time.total, len(best.offload)):
            uploaded = int(on_device.sum())
            i, j = _savings(model, mem, blocks, uploaded, max_blocks) if offload is None else (np.nan, np.nan)
            best = Placement(blocks, on_device, time, mem.device(blocks, on_device), mem.host(on_device), i, j)
    return best


def _fill(mem: ArenaBytes, budget: Budget, on_device: np.ndarray, max_blocks: int) -> int:
    """As many rCache blocks as the budget leaves room for (up to one per public chunk)."""
    free = budget.allowed - mem.device(0, on_device)
    return int(min(max_blocks, max(0, free // mem.buffer)))


def offloaded_chunks(offload: float | Sequence[int], n_chunks: int, chunk_size: int) -> list[int]:
    """``ElixirConfig.offload`` for a layout of ``n_chunks``: a fraction takes the last chunks (their
    gradients arrive first in backward), a list is checked against the layout."""
    if isinstance(offload, (float, int)) and not isinstance(offload, bool):
        return list(range(n_chunks - round(float(offload) * n_chunks), n_chunks))
    chunks = sorted({int(i) for i in cast(Sequence[int], offload)})  # a bool is neither: ElixirConfig refuses it
    bad = [i for i in chunks if not 0 <= i < n_chunks]
    if bad:
        raise PlanError(
            f"offload names chunks {bad}, but with chunks of {chunk_size:,} elements the layout "
            f"has chunks 0..{n_chunks - 1}: give chunk_size too, or offload as a fraction"
        )
    return chunks
