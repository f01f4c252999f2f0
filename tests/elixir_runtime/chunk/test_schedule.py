"""``AccessSchedule``: Belady over the recorded trace, LRU fallback on divergence, prefetch order.

The engine calls ``access(chunk)`` for every demand access, then (on a miss with a full rCache)
evicts the gathered chunk with the largest ``eviction_score``. The cache simulations below do
exactly that and compare the resulting misses with brute-force optimal replacement.
"""

from __future__ import annotations

import functools
import math
import random
from collections import OrderedDict

import pytest

from elixir_runtime.chunk.schedule import AccessSchedule


def _next_use(trace: list[int], now: int, chunk: int) -> float:
    """Distance from position ``now`` to the next access of ``chunk`` (inf if never)."""
    for j in range(now, len(trace)):
        if trace[j] == chunk:
            return float(j - now)
    return math.inf


def _random_trace(rng: random.Random, n_chunks: int, length: int) -> list[int]:
    return [rng.randrange(n_chunks) for _ in range(length)]


def _record(sched: AccessSchedule, trace: list[int], kind="train") -> None:
    sched.begin(kind)
    for c in trace:
        sched.access(c)
    sched.end()


# --------------------------------------------------------------------------- cache simulations


def _simulate_schedule(sched: AccessSchedule, trace: list[int], capacity: int, kind="train") -> int:
    """The engine's policy: record access, then on a miss evict max eviction_score."""
    sched.begin(kind)
    cache: set[int] = set()
    misses = 0
    for c in trace:
        sched.access(c)
        if c in cache:
            continue
        misses += 1
        if len(cache) >= capacity:
            victim = max(cache, key=sched.eviction_score)
            cache.remove(victim)
        cache.add(c)
    sched.end()
    return misses


def _simulate_lru(trace: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for c in trace:
        if c in cache:
            cache.move_to_end(c)
            continue
        misses += 1
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[c] = None
    return misses


def _simulate_fifo(trace: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for c in trace:
        if c in cache:
            continue
        misses += 1
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[c] = None
    return misses


def _simulate_random(trace: list[int], capacity: int, seed: int) -> int:
    rng = random.Random(seed)
    cache: list[int] = []
    misses = 0
    for c in trace:
        if c in cache:
            continue
        misses += 1
        if len(cache) >= capacity:
            cache.pop(rng.randrange(len(cache)))
        cache.append(c)
    return misses


def _opt_exhaustive(trace: list[int], capacity: int) -> int:
    """Minimum misses over every possible eviction choice (demand paging), by memoised search."""
    trace_t = tuple(trace)

    @functools.cache
    def best(pos: int, cache: frozenset[int]) -> int:
        if pos == len(trace_t):
            return 0
        c = trace_t[pos]
        if c in cache:
            return best(pos + 1, cache)
        if len(cache) < capacity:
            return 1 + best(pos + 1, cache | {c})
        return 1 + min(best(pos + 1, (cache - {v}) | {c}) for v in cache)

    return best(0, frozenset())


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", range(20))
def test_eviction_choice_is_farthest_next_use(seed: int) -> None:
    rng = random.Random(seed)
    trace = _random_trace(rng, n_chunks=rng.randint(2, 8), length=rng.randint(5, 30))
    chunks = sorted(set(trace)) + [99]  # 99: gathered but never used by the trace
    sched = AccessSchedule()
    _record(sched, trace)  # first iteration records
    sched.begin("train")  # second follows
    for now in range(len(trace) + 1):
        for c in chunks:
            assert sched.eviction_score(c) == _next_use(trace, now, c), (now, c)
        candidates = rng.sample(chunks, k=min(len(chunks), 3))
        chosen = max(candidates, key=sched.eviction_score)
        assert _next_use(trace, now, chosen) == max(_next_use(trace, now, c) for c in candidates)
        if now < len(trace):
            sched.access(trace[now])


def test_first_iteration_is_not_belady() -> None:
    # nothing recorded yet: scores are LRU staleness, below any Belady distance
    sched = AccessSchedule()
    sched.begin("train")
    for c in [0, 1, 2]:
        sched.access(c)
    assert max([0, 1, 2], key=sched.eviction_score) == 0
    assert all(sched.eviction_score(c) < 0 for c in [0, 1, 2])
    assert list(sched.upcoming()) == []


@pytest.mark.parametrize("seed", range(30))
def test_schedule_cache_is_optimal(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n_chunks = rng.randint(3, 6)
    capacity = rng.randint(1, n_chunks - 1)
    trace = _random_trace(rng, n_chunks, rng.randint(6, 14))

    sched = AccessSchedule()
    first = _simulate_schedule(sched, trace, capacity)  # recording iteration: LRU
    assert first == _simulate_lru(trace, capacity)
    misses = _simulate_schedule(sched, trace, capacity)  # following iteration: Belady

    opt = _opt_exhaustive(trace, capacity)
    assert misses == opt
    assert misses <= _simulate_lru(trace, capacity)
    assert misses <= _simulate_fifo(trace, capacity)
    for s in range(5):
        assert misses <= _simulate_random(trace, capacity, s)
    # and it stays optimal on later iterations (the trace is not disturbed by following it)
    assert _simulate_schedule(sched, trace, capacity) == opt


def test_schedule_beats_lru_on_cyclic_trace() -> None:
    # classic LRU worst case: a loop one larger than the cache misses every time under LRU
    trace = [0, 1, 2, 3] * 4
    sched = AccessSchedule()
    _simulate_schedule(sched, trace, 3)
    misses = _simulate_schedule(sched, trace, 3)
    assert _simulate_lru(trace, 3) == len(trace)
    assert misses == _opt_exhaustive(trace, 3) < len(trace)


def test_divergence_falls_back_to_lru_and_rerecords() -> None:
    sched = AccessSchedule()
    _record(sched, [0, 1, 2, 3, 0, 1])
    sched.begin("train")
    sched.access(0)
    sched.access(1)
    # following: chunk 2 is next (distance 0), 3 at 1, 0 at 2
    assert sched.eviction_score(0) == 2.0
    assert list(sched.upcoming())[:2] == [(2, 0), (3, 1)]
    sched.access(3)  # diverges: the trace expected 2
    assert list(sched.upcoming()) == []
    # LRU: the least recently used gathered chunk scores highest, whatever the old trace said
    scores = {c: sched.eviction_score(c) for c in (0, 1, 3)}
    assert max(scores, key=scores.get) == 0
    assert scores[0] > scores[1] > scores[3]
    sched.access(0)
    scores = {c: sched.eviction_score(c) for c in (0, 1, 3)}
    assert max(scores, key=scores.get) == 1
    # stays LRU for the rest of the iteration, even if accesses happen to match the old trace again
    sched.access(0)
    sched.access(1)
    assert list(sched.upcoming()) == []
    sched.end()

    # the divergent iteration became the new trace
    new = [0, 1, 3, 0, 0, 1]
    sched.begin("train")
    for now in range(len(new)):
        for c in (0, 1, 2, 3):
            assert sched.eviction_score(c) == _next_use(new, now, c)
        sched.access(new[now])


def test_shorter_iteration_rerecords() -> None:
    sched = AccessSchedule()
    _record(sched, [0, 1, 2, 3])
    _record(sched, [0, 1])  # follows as far as it goes, but ends early: becomes the trace
    sched.begin("train")
    assert list(sched.upcoming()) == [(0, 0), (1, 1)]
    assert sched.eviction_score(2) == math.inf


def test_completely_followed_iteration_keeps_trace() -> None:
    sched = AccessSchedule()
    _record(sched, [0, 1, 2])
    _record(sched, [0, 1, 2])
    sched.begin("train")
    assert list(sched.upcoming()) == [(0, 0), (1, 1), (2, 2)]


def test_traces_are_kept_per_kind() -> None:
    sched = AccessSchedule()
    _record(sched, [0, 1, 2, 3], kind=(True, True))  # training forward + backward
    _record(sched, [3, 2], kind=(False, False))  # eval forward
    sched.begin((True, True))
    assert [c for c, _ in sched.upcoming()] == [0, 1, 2, 3]
    sched.access(0)
    sched.end()
    sched.begin((False, False))
    assert [c for c, _ in sched.upcoming()] == [3, 2]
    assert sched.eviction_score(0) == math.inf
    sched.end()
    # the short training iteration above re-recorded only its own kind
    sched.begin((True, True))
    assert list(sched.upcoming()) == [(0, 0)]


@pytest.mark.parametrize("seed", range(10))
def test_upcoming_distinct_nearest_first(seed: int) -> None:
    rng = random.Random(seed)
    trace = _random_trace(rng, rng.randint(2, 6), rng.randint(5, 25))
    sched = AccessSchedule()
    _record(sched, trace)
    sched.begin("train")
    for now in range(len(trace) + 1):
        up = list(sched.upcoming())
        chunks = [c for c, _ in up]
        distances = [d for _, d in up]
        assert len(chunks) == len(set(chunks))
        assert distances == sorted(distances)
        assert len(set(distances)) == len(distances)
        expected = []
        for j in range(now, len(trace)):
            if trace[j] not in [c for c, _ in expected]:
                expected.append((trace[j], j - now))
        assert up == expected
        if now < len(trace):
            sched.access(trace[now])
