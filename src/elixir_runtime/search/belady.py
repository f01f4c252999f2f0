"""Belady replacement of the rCache simulated for every cache size in one pass.

The engine acquires a unit's chunks together and pins them while they are gathered; on a miss
with every block taken it evicts the unpinned chunk whose next use is farthest away (never again
counts as infinitely far). Such a policy ranks chunks by a priority that does not depend on the
cache size, so it is a *stack algorithm* (Mattson et al., 1970): the contents of a cache of ``b``
blocks are always the top ``b`` entries of one priority stack. One pass over the trace therefore
yields, for every access, the smallest cache that hits it (its *stack distance*), and the misses
of every cache size follow by counting, instead of one simulation per size.

Stack update on an access of chunk ``x`` found at depth ``d``: ``x`` goes on top, and walking down
to depth ``d`` the higher-priority of (carried entry, entry in place) stays, the other is carried
on; the carried entry lands where ``x`` was. Priority: chunks already acquired in the current group
are pinned (highest); otherwise a sooner next use ranks higher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["COLD", "stack_distances", "MissTable"]

COLD = np.iinfo(np.int64).max
"""Stack distance of a first access: a miss at every cache size."""


def _next_uses(flat: Sequence[int]) -> list[float]:
    nxt = [math.inf] * len(flat)
    last: dict[int, int] = {}
    for t in range(len(flat) - 1, -1, -1):
        nxt[t] = last.get(flat[t], math.inf)
        last[flat[t]] = t
    return nxt


def stack_distances(groups: Sequence[Sequence[int]]) -> np.ndarray:
    """For each access of ``groups`` (flattened in order), the fewest blocks that make it a hit."""
    flat = [c for g in groups for c in g]
    group_of = [gi for gi, g in enumerate(groups) for _ in g]
    nxt = _next_uses(flat)
    next_use: dict[int, float] = {}
    pinned_in: dict[int, int] = {}
    stack: list[int] = []
    out: list[int] = []
    for t, x in enumerate(flat):
        g = group_of[t]
        try:
            d = stack.index(x)
            out.append(d + 1)
        except ValueError:
            d = len(stack)
            stack.append(x)
            out.append(COLD)
        if d > 0:
            # the carried block outranks the one here if pinned in this group and it is not, or
            # both or neither are and it is used sooner
            carried = stack[0]
            stack[0] = x
            c_pinned, c_next = pinned_in.get(carried) == g, next_use[carried]
            for i in range(1, d):
                here = stack[i]
                h_pinned, h_next = pinned_in.get(here) == g, next_use[here]
                if c_pinned if c_pinned != h_pinned else c_next < h_next:
                    stack[i], carried, c_pinned, c_next = carried, here, h_pinned, h_next
            stack[d] = carried
        next_use[x] = nxt[t]
        pinned_in[x] = g
    return np.array(out, dtype=np.int64)


class MissTable:
    """Misses per chunk and phase for any number of rCache blocks, from one simulation."""

    def __init__(self, groups: Sequence[Sequence[int]], phases: Sequence[int], n_chunks: int) -> None:
        """``phases[i]`` is 0 (forward) or 1 (backward) for group ``i``."""
        self.n_chunks = n_chunks
        self.groups = [tuple(g) for g in groups]
        self.chunk = np.array([c for g in groups for c in g], dtype=np.int64)
        self.phase = np.array([p for g, p in zip(groups, phases) for _ in g], dtype=np.int64)
        self.distance = stack_distances(groups)
        self._cache: dict[int, np.ndarray] = {}
        self._inline: dict[int, np.ndarray] = {}

    def misses(self, n_blocks: int) -> np.ndarray:
        """``[2, n_chunks]``: gathers of each chunk in forward (row 0) and backward (row 1)."""
        hit = self._cache.get(n_blocks)
        if hit is None:
            self._cache[n_blocks] = hit = self._count(self.distance > n_blocks)
        return hit

    def inline(self, n_blocks: int) -> np.ndarray:
        """``[2, n_chunks]``: the gathers of ``misses`` that no prefetch can run ahead of their
        group, for want of a free block ([Note: gathers in line])."""
        hit = self._inline.get(n_blocks)
        if hit is None:
            self._inline[n_blocks] = hit = self._count(self._in_line(n_blocks))
        return hit

    def _in_line(self, n_blocks: int) -> np.ndarray:
        """[Note: gathers in line] A gather ahead of its group needs a block, and while the group
        before it computes, that group's chunks hold theirs (pinned, and the buffer of one evicted
        is free only once its last user is done), as do the group's own chunks found in the cache:
        the group's misses beyond the blocks left, in acquire order, wait for the group before to
        finish, in line with the compute (an rCache at its minimum gathers every miss so).
        Re-gathers of chunks evicted earlier are ``misses``. Not modelled: the prefetch depth (the
        engine prefetches ``ElixirConfig.prefetch`` chunks at a time; one rank's uploads of
        offloaded chunks, issued at the acquire, wait only for their block)."""
        miss = (self.distance > n_blocks).tolist()  # Python lists: a group holds a few chunks
        inline: list[int] = []
        pos, before = 0, frozenset[int]()
        for g in self.groups:
            mine = miss[pos : pos + len(g)]
            held = before | {c for c, m in zip(g, mine) if not m}
            left = max(0, n_blocks - len(held))
            inline += [pos + i for i, m in enumerate(mine) if m][left:]  # the first ``left`` misses are prefetched
            pos, before = pos + len(g), frozenset(g)
        out = np.zeros(len(miss), dtype=bool)
        out[inline] = True
        return out

    def _count(self, accesses: np.ndarray) -> np.ndarray:
        out = np.zeros((2, self.n_chunks), dtype=np.int64)
        np.add.at(out, (self.phase[accesses], self.chunk[accesses]), 1)
        return out
