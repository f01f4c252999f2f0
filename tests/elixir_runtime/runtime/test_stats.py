"""The engine's counters (``runtime/stats.py``): typed, added to together, read as a mapping for logs."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_runtime.runtime.stats import EngineStats, StatsCounter


def test_counts_add_up_and_a_reading_does_not_move():
    stats = StatsCounter()
    stats.add(gathers=1)
    before = stats.now
    stats.add(gathers=2, updated_cpu=10, cpu_update_s=0.5)
    assert before.gathers == 1 and before.updated_cpu == 0  # a reading is the counters at that moment
    assert (stats.now.gathers, stats.now.updated_cpu, stats.now.cpu_update_s) == (3, 10, 0.5)


def test_a_reading_is_a_mapping_of_every_counter():
    now = StatsCounter().now
    assert dict(now) == dataclasses.asdict(now) and list(now) == [f.name for f in dataclasses.fields(EngineStats)]
    assert now["reduces"] == 0 and "update_wait_s" in now and "nothing" not in now
    with pytest.raises(KeyError):
        now["_counts"]


def test_an_unknown_counter_is_an_error():
    with pytest.raises(KeyError, match="gather"):
        StatsCounter().add(gather=1)
