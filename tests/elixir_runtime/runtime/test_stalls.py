"""The GPU's idle at acquires that wait for a gather (``runtime/stalls.py``): the marks a forward makes,
which counter each goes to, and how recorded event pairs are counted."""

from __future__ import annotations

import time

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.runtime.stalls import StallClock
from elixir_runtime.runtime.stats import StatsCounter
from helpers.device import ON_CUDA
from helpers.training import Recipe, batch_for, build


class _Gpu:
    """A compute stream as a list of recorded events and a clock: an event has run once the clock passed it."""

    def __init__(self) -> None:
        self.now, self.ran_until = 0.0, 0.0
        self.log: list[str] = []

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "elapsed_time needs timing events"
                self.at: float | None = None

            def record(self, stream=None) -> None:
                self.at = gpu.now
                gpu.log.append(f"record {gpu.now}")

            def query(self) -> bool:
                gpu.log.append(f"query {self.at}")
                return self.at is not None and self.at <= gpu.ran_until

            def elapsed_time(self, end) -> float:
                return (end.at - self.at) * 1e3  # milliseconds, as CUDA's

        return Event


def test_pairs_are_counted_oldest_first_once_their_end_has_run(monkeypatch):
    gpu = _Gpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    stats = StatsCounter()
    clock = StallClock(stats, cuda=True)
    for start, end, counter in (
        (1.0, 1.25, "update_stall_s"),
        (2.0, 2.5, "gather_stall_s"),
        (3.0, 3.125, "update_stall_s"),
    ):
        gpu.now = start
        mark = clock.start()
        gpu.now = end
        clock.stop(mark, counter)
    gpu.ran_until = 2.0  # the first pair has run, the second's end has not
    clock.settle()
    assert (stats.now.update_stall_s, stats.now.gather_stall_s) == (pytest.approx(0.25), 0.0)
    gpu.ran_until = 3.125
    clock.settle()
    assert (stats.now.update_stall_s, stats.now.gather_stall_s) == (pytest.approx(0.375), pytest.approx(0.5))
    clock.settle()  # nothing is counted twice
    assert (stats.now.update_stall_s, stats.now.gather_stall_s) == (pytest.approx(0.375), pytest.approx(0.5))


def test_settle_does_not_query_past_a_pair_that_has_not_run(monkeypatch):
    gpu = _Gpu()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    clock = StallClock(StatsCounter(), cuda=True)
    for t in (1.0, 2.0):
        gpu.now = t
        clock.stop(clock.start(), "gather_stall_s")
    gpu.log.clear()
    clock.settle()
    assert gpu.log == ["query 1.0"]  # the oldest pair's end: not run, so the newer one is not read


def test_off_cuda_the_stall_is_the_loops_own_time(monkeypatch):
    now = iter((10.0, 10.25, 20.0, 20.5))
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    stats = StatsCounter()
    clock = StallClock(stats, cuda=False)
    clock.stop(clock.start(), "gather_stall_s")
    clock.stop(clock.start(), "update_stall_s")
    assert (stats.now.gather_stall_s, stats.now.update_stall_s) == (0.25, 0.5)


def _marks_of_one_forward(offload: float, monkeypatch) -> tuple[int, dict[str, int], float, float]:
    """Trains one step (its CPU updates of offloaded chunks queued), then runs one forward with
    every update looking busy (no prefetch gathers one: each is a demand gather, whatever the CPU
    lane's speed): the chunks pending before it, the acquires the stall clock marked by counter,
    and the update stall and wait seconds that forward counted."""
    recipe = Recipe(steps=2)
    model, opt = build(recipe)
    cfg = er.ElixirConfig(mode="static", n_blocks="min", offload=offload, prefetch=2)
    model, opt = er.prepare(model, opt, cfg, example_batch=batch_for(recipe, 0, 0, 0))
    runtime = model._elixir.runtime
    opt.backward(model(**batch_for(recipe, 0, 0, 0)).loss)
    opt.step()
    opt.zero_grad()
    marked = {"update_stall_s": 0, "gather_stall_s": 0}
    stop = runtime.gathers.stalls.stop

    def counted(mark, counter):
        marked[counter] += 1
        stop(mark, counter)

    monkeypatch.setattr(runtime.gathers.stalls, "stop", counted)
    monkeypatch.setattr(runtime.host_updates, "busy", lambda chunk: True)
    pending = [i for i in range(len(runtime.chunks)) if runtime.host_updates.pending(i)]
    before = runtime.stats
    model(**batch_for(recipe, 1, 0, 0))
    if ON_CUDA:
        torch.cuda.synchronize()  # every pair has run: all are counted
    after = runtime.stats
    assert not any(runtime.host_updates.pending(i) for i in pending)  # each waited for in the forward
    return (
        len(pending),
        marked,
        after.update_stall_s - before.update_stall_s,
        after.update_wait_s - before.update_wait_s,
    )


def test_a_forward_marks_each_gather_that_waits_for_an_update(monkeypatch):
    """Every offloaded chunk's update is pending at its first gather of the next forward
    (``pending`` is the queue's record, not the update's progress): each acquire that gathers one
    is marked once. On the CPU each mark spans the loop's wait and the gather; on a GPU the upload
    of a demand gather runs in line, so the GPU idles for it at least."""
    pending, marks, stall, wait = _marks_of_one_forward(1.0, monkeypatch)
    assert 0 < marks["update_stall_s"] <= pending
    assert stall > 0.0 and wait >= 0.0
    if not ON_CUDA:
        assert stall >= wait


def test_with_nothing_offloaded_a_forwards_demand_gathers_are_gather_stalls(monkeypatch):
    pending, marks, stall, wait = _marks_of_one_forward(0.0, monkeypatch)
    assert (pending, marks["update_stall_s"], stall, wait) == (0, 0, 0.0, 0.0)
    assert marks["gather_stall_s"] > 0  # the rCache at its minimum: the forward gathers on demand
