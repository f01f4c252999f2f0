"""``benchmarks.replay`` predicts a recorded plan again, offline: a run recorded by the harness
replays to exactly the prediction its plan carried; runs without plan inputs, or compiled (the
replay traces the model uncompiled), are skipped, saying why; the runs in
docs/benchmarks/results.json replay within a tenth of their measured step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from benchmarks import replay, report
from benchmarks.harness import plan_summary
from benchmarks.models import PRESETS, build_meta
from elixir_hf.patches import mask_decisions_of
from elixir_runtime.config import ElixirConfig
from elixir_runtime.hardware.profile import CpuAdamRate, HardwareProfile, LinkRates
from elixir_runtime.planner import PlanJob, Target, plan_model
from elixir_runtime.search import Budget
from elixir_runtime.units import find_units

GIB = 2**30
SEQ = 64
RESULTS = Path(__file__).parents[2] / "docs" / "benchmarks" / "results.json"


def _hardware() -> HardwareProfile:
    return HardwareProfile(
        device="test GPU",
        gpus=2,
        gpu_memory=80 * GIB,
        host_memory=256 * GIB,
        cpu_cores=32,
        matmul={"256": 50e12, "1024": 300e12},
        attention={"2048": 300e12},
        memory_bandwidth=3e12,
        op_overhead=1e-5,
        gpu_adam=80e9,
        cpu_adam={2: CpuAdamRate(2, 15, 1.5e9, 3e9)},
        links={n: LinkRates(n, 50e9 * n, 50e9 * n, 35e9 * n, 200e9 if n > 1 else None) for n in (1, 2)},
    )


def _recorded_run(batch: int = 2, gpus: int = 2) -> dict:
    """What the harness records for an Elixir run whose plan offloads half the chunks."""
    dtype = torch.bfloat16
    model = build_meta(PRESETS["tiny"], SEQ, dtype)
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")

    def budget(profile):
        return Budget(80 * GIB, profile.activation_peak, profile.buffer_bytes, 256 * GIB, gpus)

    target = Target(gpus, _hardware(), budget, busbw=150e9)
    config = ElixirConfig(offload=0.5, n_blocks="min", clips_grads=False)
    inputs = {"input_ids": ids, "labels": ids}
    with mask_decisions_of(inputs):  # as the harness's elixir system plans
        job = PlanJob(model, find_units(model, None), inputs, config, torch.device("cuda"), dtype)
        plan = plan_model(job, target).plan
    assert plan.offload, "the case must offload"
    return {
        "system": "elixir",
        "status": "ok",
        "model": "tiny",
        "gpus": gpus,
        "batch": batch,
        "seq": SEQ,
        "card": "test GPU",
        "step_s": 1.1 * plan.predicted_step_s,
        "predicted_step_s": plan.predicted_step_s,
        "info": {"plan": plan_summary(plan)},
    }


def test_a_recorded_run_replays_to_its_own_prediction() -> None:
    run = _recorded_run()
    [row] = replay.replay([run])
    assert row["replayed_step_s"] == run["predicted_step_s"]
    assert abs(row["measured_over_replayed"] - 1.1) < 1e-9
    assert "1 runs replayed" in replay.render([row])


def test_runs_without_plan_inputs_are_skipped() -> None:
    run = _recorded_run()
    del run["info"]["plan"]["hardware"]
    [row] = replay.replay([run])
    assert "skipped" in row and "replayed_step_s" not in row
    assert "skipped" in replay.render([row])


def test_compiled_runs_and_liger_runs_without_liger_are_skipped_saying_why(monkeypatch) -> None:
    """The replay traces the model uncompiled; a Liger run is traced with Liger's kernels, where
    liger-kernel is installed."""
    run = _recorded_run()
    run["info"]["compile"] = True
    [row] = replay.replay([run])
    assert row["skipped"].startswith("torch.compile") and "replayed_step_s" not in row
    run = _recorded_run()
    run["info"]["liger"] = True
    monkeypatch.setattr(replay.importlib.util, "find_spec", lambda name: None)
    [row] = replay.replay([run])
    assert "liger-kernel is not installed" in row["skipped"]


def test_a_run_that_recorded_its_cpu_update_rate_replays_at_it_too() -> None:
    """The slowest rank's rate, as a job records it for its machine (``CpuAdamRate.observed``):
    1 M elements/s, far below the profile's, makes the offloaded updates the step."""
    run = _recorded_run()
    run["cpu_update_Gps_per_rank"] = [0.002, 0.001]
    [row] = replay.replay([run])
    assert row["own_rate_Gps"] == 0.001 and row["replayed_step_s"] == run["predicted_step_s"]
    assert row["replayed_own_step_s"] > 2 * row["replayed_step_s"]
    assert row["measured_over_own"] == run["step_s"] / row["replayed_own_step_s"]
    assert "(0.00) |" in replay.render([row])
    del run["cpu_update_Gps_per_rank"]
    run["info"]["runtime_stats"] = {"updated_cpu": 3e6, "cpu_update_s": 1.5}  # rank 0's only, older records
    assert replay.own_rate(run) == 2e6
    run["info"]["skip_nonfinite"] = False  # no host sync before the update: the rate is not used
    assert replay.own_rate(run) is None
    del run["info"]["runtime_stats"]
    [row] = replay.replay([run])
    assert "own_rate_Gps" not in row and replay.render([row]).splitlines()[2].endswith("| – |")


def _recorded_elixir_runs(regime: str, liger: bool) -> list[dict]:
    """The Elixir runs of results.json in ``regime`` (``report.regime`` of their group), with or
    without Liger's kernels."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in report.load_runs(RESULTS):
        groups.setdefault(report.run_key(r)[:-1], {})[r["system"]] = r
    return [
        r
        for group in groups.values()
        if report.regime(group) == regime
        for r in group.values()
        if r["system"] in report.ELIXIR_SYSTEMS and r.get("status") == "ok" and report.ligered(r) == liger
    ]


@pytest.mark.parametrize("liger", [False, True], ids=["eager", "liger"])
@pytest.mark.parametrize("regime", ["offload", "in_gpu"])
def test_the_recorded_runs_replay_within_a_tenth_of_their_measured_step(regime: str, liger: bool) -> None:
    """The step model as it is now against every replayable run measured (docs/benchmarks.md's
    replay section): a change to ``search/step_time.py`` that mispredicts one fails here."""
    if liger and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("the Liger runs replay with Liger's kernels: liger-kernel is not installed (the dev extra)")
    rows = replay.replay(_recorded_elixir_runs(regime, liger))
    replayed = [r for r in rows if "skipped" not in r]
    assert replayed, f"no replayable {regime} run in {RESULTS}"
    off = {
        f"{r['card']} {r['model']} {r['gpus']} GPUs bs {r['batch']}": round(r["measured_over_replayed"], 3)
        for r in replayed
        if abs(r["step_s"] - r["replayed_step_s"]) > 0.1 * r["step_s"]
    }
    assert not off, f"measured / predicted beyond 10 %: {off}"
