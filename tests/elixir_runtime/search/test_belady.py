"""The search's Belady simulator (one pass, every cache size) against brute force.

``tests/elixir_runtime/chunk/test_schedule.py`` tests the runtime's ``AccessSchedule``; this is
the planner's own simulator, with the runtime's rule that a unit's chunks are pinned together.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import numpy as np
import pytest

from elixir_runtime.search.belady import COLD, MissTable, _next_uses, stack_distances


def _brute_force(groups: list[tuple[int, ...]], blocks: int) -> int:
    """Fewest misses of any eviction choices that never evict a chunk of the group being acquired."""
    flat = [(g, c) for g, group in enumerate(groups) for c in group]

    @functools.cache
    def best(t: int, cache: frozenset) -> float:
        if t == len(flat):
            return 0
        g, x = flat[t]
        if x in cache:
            return best(t + 1, cache)
        if len(cache) < blocks:
            return 1 + best(t + 1, cache | {x})
        pinned = {c for h, c in flat[:t] if h == g}
        options = [1 + best(t + 1, (cache - {v}) | {x}) for v in cache - pinned]
        return min(options, default=float("inf"))

    return best(0, frozenset())


def _random_groups(rng: random.Random, chunks: int, length: int) -> list[tuple[int, ...]]:
    return [tuple(rng.sample(range(chunks), rng.randint(1, min(3, chunks)))) for _ in range(length)]


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_equals_simulation_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        chunks = rng.randint(2, 6)
        groups = _random_groups(rng, chunks, rng.randint(1, 9))
        distances = stack_distances(groups)
        for blocks in range(max(len(g) for g in groups), chunks + 1):
            misses = int((distances > blocks).sum())
            assert misses == simulate(groups, blocks) == _brute_force(groups, blocks), (groups, blocks)


def test_forward_backward_trace_refetches_what_the_cache_cannot_keep() -> None:
    """Forward 0..K-1, backward K-1..0: b blocks keep the last b chunks across the turn."""
    k = 10
    groups = [(c,) for c in range(k)] + [(c,) for c in reversed(range(k))]
    table = MissTable(groups, [0] * k + [1] * k, k)
    for blocks in range(1, k + 1):
        m = table.misses(blocks)
        assert m[0].tolist() == [1] * k
        assert m[1].tolist() == [1] * (k - blocks) + [0] * blocks


def test_cold_accesses_and_monotone_misses() -> None:
    rng = random.Random(7)
    groups = _random_groups(rng, 8, 60)
    distances = stack_distances(groups)
    first = {}
    for t, c in enumerate(c for g in groups for c in g):
        first.setdefault(c, t)
    assert all(distances[t] == COLD for t in first.values())
    table = MissTable(groups, [i % 2 for i in range(len(groups))], 8)
    totals = [int(table.misses(b).sum()) for b in range(3, 9)]
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] == 8  # enough blocks for everything: compulsory misses only
    assert np.array_equal(table.misses(5), table.misses(5))


def test_too_few_blocks_for_a_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot hold a group"):
        simulate([(0, 1, 2)], 2)


# The oracle the stack pass is tested against (test-only: the search uses MissTable).
def simulate(groups: Sequence[Sequence[int]], n_blocks: int) -> int:
    """Misses of one cache size by direct simulation (the reference the stack pass is tested on)."""
    flat = [c for g in groups for c in g]
    nxt = _next_uses(flat)
    next_use: dict[int, float] = {}
    resident: set[int] = set()
    misses = t = 0
    for group in groups:
        pinned: set[int] = set()
        for x in group:
            if x not in resident:
                misses += 1
                if len(resident) >= n_blocks:
                    victims = resident - pinned
                    if not victims:
                        raise ValueError(f"{n_blocks} blocks cannot hold a group of {len(group)} chunks")
                    resident.remove(max(victims, key=lambda c: next_use[c]))
                resident.add(x)
            next_use[x] = nxt[t]
            pinned.add(x)
            t += 1
    return misses
