"""The plan's ``elixir/plan_*`` log values (``plan_view.plan_metrics``): all of them in the first log
(a searched plan adds the CPU update rate it priced, beside which a run's ``elixir/cpu_update_Gps``
shows what the host gave), its predictions of what the run measures in every log (``COMPARED``)."""

from __future__ import annotations

import dataclasses

from elixir_hf.metrics import COMPARED, _plan_metrics, _predicted
from elixir_runtime import ElixirPlan
from elixir_runtime.search import RateSummary, SearchReport, StepTime

STATIC = ElixirPlan(
    chunk_size=4096, n_blocks=3, offload=[2], n_chunks=4, world_size=1, dtype="bfloat16", min_blocks=2, max_blocks=4
)


def test_a_searched_plan_logs_its_prediction_and_cpu_rate() -> None:
    times = dict.fromkeys(("compute", "h2d", "d2h", "exposed_transfers"), 0.5)
    predicted = StepTime(
        **times, total=1.5, gpu_adam=0.1, cpu_adam=0.3, collectives=None, exposed_cpu_adam=0.2, rcache_bytes=0, serial=2
    )
    memory = dataclasses.replace(STATIC.memory, rcache=2**30, host_shards=2**31, activations=2**30, buffers=0)
    report = SearchReport(i_per_gib=None, j_per_gib=None, rates=RateSummary(cpu_update_Gps=4.4))
    searched = dataclasses.replace(STATIC, predicted=predicted, memory=memory, search=report)
    got = _plan_metrics(searched)
    assert got["elixir/plan_step_s"] == 1.5 and got["elixir/plan_cpu_update_Gps"] == 4.4
    assert "elixir/plan_cpu_update_Gps" not in _plan_metrics(dataclasses.replace(searched, offload=[]))
    assert _predicted(searched) == {
        "elixir/plan_step_s": 1.5,
        "elixir/plan_optimizer_s": 0.1,
        "elixir/plan_cpu_update_s": 0.3,
        "elixir/plan_update_wait_s": 0.2,
        "elixir/plan_gpu_peak_gib": 2.0,  # the rCache and the activations
        "elixir/plan_host_gib": 2.0,
    }
    assert set(_predicted(searched)) == {c.plan for c in COMPARED}  # the renderer predicts every comparison
    assert _predicted(searched).items() <= got.items()  # the first log has them too
    assert "elixir/plan_cpu_update_s" not in _predicted(dataclasses.replace(searched, offload=[]))
    static = _plan_metrics(STATIC)
    assert "elixir/plan_step_s" not in static and static["elixir/plan_offloaded_chunks"] == 1
    assert _predicted(STATIC) == {"elixir/plan_host_gib": 0.0}  # a static plan predicts no time, no peak
