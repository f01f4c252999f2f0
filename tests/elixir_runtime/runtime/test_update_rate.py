"""The probe of a job's own CPU update rate (``runtime/update_rate.py``): which steps count, what it
reports and when, fed by the engine's CPU lane (on CPU: the "offloaded" arenas are host memory
either way, the lane and its counters are the GPU run's)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.hardware.load import ENV_HARDWARE, cache_path
from elixir_runtime.hardware.profile import CpuAdamRate, HardwareProfile
from elixir_runtime.kernels.threads import cpu_adam_threads
from elixir_runtime.runtime.stats import StatsCounter
from elixir_runtime.runtime.update_rate import SKIP, STEPS, UpdateRateProbe
from helpers.device import ON_CUDA
from helpers.training import Recipe, batch_for, build, run_elixir
from tests.elixir_runtime.search.search_cases import gpu_host


def _feed(probe: UpdateRateProbe, steps: list[tuple[int, float, bool]]) -> None:
    """Each step's (elements, busy seconds, synced) added to the counters, then seen by the next
    ``step()``'s call (the first call, before any step, sees nothing)."""
    if probe.calls == 0:
        probe.step_done(False)
    for elements, busy, synced in steps:
        probe.stats.add(updated_cpu=elements, cpu_update_s=busy)
        probe.step_done(synced)


def test_reports_the_median_of_the_synced_steps_after_the_warmup_once() -> None:
    reports: list[float] = []
    probe = UpdateRateProbe(StatsCounter(), reports.append)
    warmup = [(100, 1.0, True)] * SKIP  # steps 1 and 2: not counted
    counted = [(4000, 1.0, True), (1000, 1.0, False), (2000, 1.0, True)] + [(3000, 1.0, True)] * (STEPS - 3)
    _feed(probe, warmup + counted[:-1])
    assert reports == []
    _feed(probe, counted[-1:])
    assert probe.rates == [4000, 2000] + [3000] * (STEPS - 3)  # the unsynced step left out
    assert reports == [3000.0]
    _feed(probe, [(9000, 1.0, True)] * 3)
    assert reports == [3000.0]  # once


def test_reports_zero_when_most_steps_were_not_synced() -> None:
    reports: list[float] = []
    probe = UpdateRateProbe(StatsCounter(), reports.append)
    _feed(probe, [(1000, 1.0, False)] * (SKIP + STEPS - 1) + [(1000, 1.0, True)])
    assert probe.rates == [1000.0] and reports == [0.0]


def _train(steps: int, **config) -> tuple[list[float], UpdateRateProbe]:
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    model, opt = er.prepare(
        model,
        opt,
        config=er.ElixirConfig(mode="static", offload=0.5, **config),
        example_batch=batch_for(recipe, 0, 0, None),
    )
    # prepare's own probe, which records the rate, is there beside a GPU only (api._rate_probe); the test's replaces it
    assert (opt.rate_probe is not None) == ON_CUDA
    reports: list[float] = []
    opt.rate_probe = UpdateRateProbe(model._elixir.runtime.ctx.stats, reports.append)
    for step in range(steps):
        opt.backward(model(**batch_for(recipe, step, 0, None)).loss)
        if config.get("skip_nonfinite", True):
            opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    return reports, opt.rate_probe


def test_the_engine_reports_its_cpu_lanes_rate_at_the_same_step_on_every_rank() -> None:
    """Each ``step()`` first waits for the updates of the step before and counts them: the report
    comes in the ``step()`` after step ``SKIP + STEPS``, a count every rank shares."""
    reports, _ = _train(SKIP + STEPS)
    assert reports == []
    reports, probe = _train(SKIP + STEPS + 1)
    assert len(probe.rates) == STEPS  # the updates of steps SKIP + 1 .. SKIP + STEPS
    assert reports == [statistics.median(probe.rates)] and reports[0] > 0


def test_updates_without_a_host_sync_are_not_counted() -> None:
    reports, _ = _train(SKIP + STEPS + 1, skip_nonfinite=False)  # no clipping, no norm: no sync
    assert reports == [0.0]


@pytest.mark.gpu
def test_a_gpu_job_records_its_rate_in_this_machines_profile(tmp_path, monkeypatch) -> None:
    """``prepare`` wires the probe beside a GPU; the step after ``SKIP + STEPS`` writes the rate as
    ``cpu_adam[1].observed`` into the cached profile (seeded: a static plan measures none)."""
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    seeded = dataclasses.replace(gpu_host(), cpu_adam={1: CpuAdamRate(1, cpu_adam_threads(1), 2e9, 4e9)})
    seeded.save(cache_path())
    recipe = Recipe(model="llama", dtype=torch.bfloat16, clip=1.0, steps=SKIP + STEPS + 1, device="cuda")
    got = run_elixir(recipe, n_blocks="min", offload=0.5)
    observed = HardwareProfile.load(cache_path()).cpu_adam[1].observed
    assert observed and observed > 0 and got.stats["updated_cpu"] > 0


@pytest.mark.gpu
def test_record_update_rate_false_leaves_the_profile_alone(monkeypatch) -> None:
    recipe = Recipe(model="llama", dtype=torch.bfloat16, clip=1.0, steps=1, device="cuda")
    model, opt = build(recipe)
    config = er.ElixirConfig(mode="static", offload=0.5, record_update_rate=False)
    _, opt = er.prepare(model, opt, config=config, example_batch=batch_for(recipe, 0, 0, None))
    assert opt.rate_probe is None
