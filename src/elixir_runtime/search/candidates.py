"""Chunk sizes worth simulating (paper appendix A.2).

The floor is the largest public parameter that fits in the most repeated unit (a transformer
block): below it the block's own weights would each need a private buffer; larger tensors (an
untied embedding, ``lm_head``) get private chunks instead of raising it. Above it: the sizes that
hold a whole number of fetch units or split a unit evenly (no padding, few chunks per unit), and a
geometric grid between. Every size is rounded to the layout's quantum (``world_size * alignment``)
exactly as ``build_layout`` will."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..chunk.layout import round_up

__all__ = ["chunk_size_candidates"]

GRID_POINTS = 12
MAX_FACTOR = 8
"""Candidates span [the floor above, MAX_FACTOR × the largest parameter]: beyond, chunks only get
coarser."""


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
    largest = round_up(max(public), quantum)
    units = Counter(n for n in unit_numels if n > 0).most_common(1)
    block = units[0][0] if units and units[0][1] > 1 else largest  # the most repeated unit
    lo = round_up(max((n for n in public if n <= block), default=largest), quantum)
    hi = max(largest, min(MAX_FACTOR * largest, round_up(sum(public), quantum)))
    sizes = {lo, largest, hi}
    sizes |= {round_up(int(lo * (hi / lo) ** (i / (GRID_POINTS - 1))), quantum) for i in range(GRID_POINTS)}
    common = [n for n, _ in Counter(unit_numels).most_common(2) if n > 0]
    for unit in common:
        sizes |= {round_up(-(-unit // j), quantum) for j in range(1, 9)}
        sizes |= {round_up(unit * j, quantum) for j in range(2, 5)}
    return sorted(s for s in sizes if lo <= s <= hi)
