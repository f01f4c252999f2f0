"""Chunk sizes worth simulating (paper appendix A.2).

A chunk can be no smaller than the largest public parameter (a parameter never spans two
chunks). Above that, what matters is how parameters pack: sizes that hold a whole number of
fetch units, or a unit in a whole number of chunks, waste no padding and keep a unit's chunks
few; a geometric grid between covers the rest. Every size is rounded to the layout's quantum
(``world_size * alignment``) exactly as ``build_layout`` will.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from ..chunk.layout import round_up

__all__ = ["chunk_size_candidates"]

GRID_POINTS = 12
MAX_FACTOR = 8
"""Candidates span [largest parameter, MAX_FACTOR × that]: beyond, chunks only get coarser."""


def chunk_size_candidates(
    numels: Sequence[int],
    private: Sequence[bool],
    unit_numels: Sequence[int],
    *,
    world_size: int,
    alignment: int,
) -> list[int]:
    """``numels`` of the parameters, ``unit_numels`` the summed (aligned) parameters per unit."""
    quantum = world_size * alignment
    public = [round_up(n, alignment) for n, p in zip(numels, private) if not p]
    if not public:
        return [quantum]
    lo = round_up(max(public), quantum)
    hi = max(lo, min(MAX_FACTOR * lo, round_up(sum(public), quantum)))
    sizes = {lo, hi}
    sizes |= {round_up(int(lo * (hi / lo) ** (i / (GRID_POINTS - 1))), quantum) for i in range(GRID_POINTS)}
    common = [n for n, _ in Counter(unit_numels).most_common(2) if n > 0]
    for unit in common:
        sizes |= {round_up(-(-unit // j), quantum) for j in range(1, 9)}
        sizes |= {round_up(unit * j, quantum) for j in range(2, 5)}
    return sorted(s for s in sizes if lo <= s <= hi)
