"""The plan's ``elixir/plan_*`` log values: a searched plan adds its predicted step and the CPU
update rate it priced, beside which a run's ``elixir/cpu_update_Gps`` shows what the host gave."""

from __future__ import annotations

import dataclasses

from elixir_hf.metrics import _plan_metrics
from elixir_runtime import ElixirPlan
from elixir_runtime.search import RateSummary, SearchReport, StepTime

STATIC = ElixirPlan(
    chunk_size=4096, n_blocks=3, offload=[2], n_chunks=4, world_size=1, dtype="bfloat16", min_blocks=2, max_blocks=4
)


def test_a_searched_plan_logs_its_prediction_and_cpu_rate() -> None:
    times = dict.fromkeys(("total", "compute", "h2d", "d2h", "gpu_adam", "cpu_adam", "exposed_transfers"), 0.5)
    predicted = StepTime(**times, collectives=None, exposed_cpu_adam=0.2, rcache_bytes=0, serial=1.0)
    report = SearchReport(i_per_gib=None, j_per_gib=None, rates=RateSummary(cpu_update_Gps=4.4))
    searched = dataclasses.replace(STATIC, predicted=predicted, search=report)
    got = _plan_metrics(searched)
    assert got["elixir/plan_step_s"] == 0.5 and got["elixir/plan_cpu_update_Gps"] == 4.4
    assert "elixir/plan_cpu_update_Gps" not in _plan_metrics(dataclasses.replace(searched, offload=[]))
    static = _plan_metrics(STATIC)
    assert "elixir/plan_step_s" not in static and static["elixir/plan_offloaded_chunks"] == 1
