"""Re-predicts measured Elixir runs with the current cost model, offline and without a GPU.

    PYTHONPATH=src python -m benchmarks.replay [docs/benchmarks/results.json ...] [--json]

GPU time is scarce; changing the step model is not. Each Elixir run of the throughput harness
records its plan (chunk size, rCache blocks, offloaded chunks), the per-rank rates and the whole
hardware profile the plan was made with. This rebuilds the same model on ``meta``, profiles the
same batch on fake tensors, and predicts the same plan on the same hardware with the code as it is
now, next to the step that was measured and the one predicted then. A change to ``search/step_time.py``
is judged against every recorded run in seconds, before a GPU session re-measures the table.

A run with Liger's kernels (``--liger``) is traced with them, as the Trainer patched its model
(``liger-kernel`` installed; else the run is skipped, saying so). Compiled runs and runs whose plan
predates these records (every run in results.json as of 2026-11-26) are listed as skipped.

"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from elixir_hf.patches import mask_decisions_of
from elixir_runtime.config import ElixirConfig
from elixir_runtime.hardware.profile import HardwareProfile
from elixir_runtime.planner import PlanJob, Target, plan_model, profile_job
from elixir_runtime.profiler.profile import ModelProfile
from elixir_runtime.search import Budget
from elixir_runtime.search.step_time import StepTime
from elixir_runtime.units import find_units

from . import report
from .models import build_meta, preset

PARTS = ("compute", "exposed_transfers", "gpu_adam", "exposed_cpu_adam")
"""The terms of the predicted step the table shows (``StepTime``; they add up to ``total``)."""

HEADROOM = 16
"""The replayed plan is the recorded one (it ran), so the budget only has to never refuse it."""


def not_replayable(run: dict[str, Any]) -> str | None:
    """Why the run cannot be predicted again offline; ``None`` if it can."""
    info = run.get("info") or {}
    plan = info.get("plan") or {}
    if not (
        run.get("system") in report.ELIXIR_SYSTEMS
        and run.get("status") == "ok"
        and bool(plan.get("hardware"))
        and "offload" in plan
    ):
        return "no recorded plan inputs (hardware, offloaded chunks)"
    if info.get("compile"):
        return "torch.compile: the replay traces the model uncompiled"
    if info.get("liger") and importlib.util.find_spec("liger_kernel") is None:
        return "Liger's kernels: liger-kernel is not installed here (pip install liger-kernel)"
    return None


@contextlib.contextmanager
def kernels_of(run: dict[str, Any], model: torch.nn.Module) -> Iterator[None]:
    """The model with the fused kernels the run had: Liger's, as the Trainer's ``use_liger_kernel``
    applies them. Liger rebinds names in the model's transformers module for the process (its norm,
    MLP and rotary embedding): put back afterwards, or the next run of that family would trace them."""
    if not run["info"].get("liger"):
        yield
        return
    from transformers.integrations.liger import apply_liger_kernel

    module = sys.modules[type(model).__module__]
    names = dict(vars(module))
    forwards = {c: c.__dict__["forward"] for c in names.values() if isinstance(c, type) and "forward" in c.__dict__}
    apply_liger_kernel(model, None)
    try:
        yield
    finally:
        for name in set(vars(module)) - set(names):
            delattr(module, name)
        for name, value in names.items():
            setattr(module, name, value)
        for cls, forward in forwards.items():
            cls.forward = forward


def own_rate(run: dict[str, Any]) -> float | None:
    """The CPU update rate the run's slowest rank had (elements/s over its steps, warm-up
    included: ``cpu_update_Gps_per_rank``, else rank 0's ``runtime_stats``), close to what a job
    records for its machine (the median of its steps 3-10); ``None`` if not recorded, or where
    the step model prices no update with it (no host sync before the update, or the device lane)."""
    info = run["info"]
    if not (run.get("clip", False) or info.get("skip_nonfinite", True)) or info["plan"].get("device_lane"):
        return None
    if run.get("cpu_update_Gps_per_rank"):
        return min(run["cpu_update_Gps_per_rank"]) * 1e9
    stats = info.get("runtime_stats") or {}
    return stats["updated_cpu"] / stats["cpu_update_s"] if stats.get("cpu_update_s") else None


def predict(run: dict[str, Any], observed: Sequence[float | None] = (None,)) -> list[StepTime]:
    """The steps the current model predicts for the run's recorded plan, batch and hardware, one per rate
    of ``observed``: ``None``, the hardware profile's CPU update rates; a rate, that one as the rate a job
    on that machine records for itself (``CpuAdamRate.observed``). The step is profiled once."""
    plan = run["info"]["plan"]
    dtype = getattr(torch, plan["dtype"])
    model = build_meta(preset(run["model"]), run["seq"], dtype)
    ids = torch.zeros(run["batch"], run["seq"], dtype=torch.long, device="meta")
    recorded = HardwareProfile.from_dict(plan["hardware"])

    def budget(profile: ModelProfile) -> Budget:
        return Budget(
            capacity=HEADROOM * recorded.gpu_memory,
            activations=profile.activation_peak,
            buffers=profile.buffer_bytes,
            host_capacity=HEADROOM * recorded.host_memory,
            ranks_per_host=run["gpus"],
        )

    def target(rate: float | None) -> Target:
        hardware = HardwareProfile.from_dict(plan["hardware"])
        if rate is not None:
            own = hardware.cpu_adam_per_rank(run["gpus"], [])
            hardware.cpu_adam[run["gpus"]] = dataclasses.replace(own, observed=rate)
        busbw = (plan.get("rates") or {}).get("busbw_GBps")
        return Target(run["gpus"], hardware, budget, busbw=busbw * 1e9 if busbw and run["gpus"] > 1 else None)

    config = ElixirConfig(
        chunk_size=plan["chunk_size"],
        n_blocks=plan["n_blocks"],
        offload=plan["offload"],
        clips_grads=bool(run.get("clip", False)),  # runs before --clip did not clip
        skip_nonfinite=bool(run["info"].get("skip_nonfinite", True)),
        device_assisted_update=bool(plan.get("device_lane")),  # as recorded, not chosen again
        moments=plan.get("moments", "fp32"),
    )
    batch = {"input_ids": ids, "labels": ids}
    with kernels_of(run, model), mask_decisions_of(batch):
        job = PlanJob(model, find_units(model, None), batch, config, torch.device("cuda"), dtype)
        profile = profile_job(job)
        return [plan_model(job, target(rate), profile=profile).plan.predicted for rate in observed]


def replay(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        row = {k: run.get(k) for k in ("card", "model", "gpus", "batch", "step_s", "predicted_step_s")}
        skipped = not_replayable(run)
        if skipped:
            rows.append({**row, "skipped": skipped})
            continue
        rate = own_rate(run)
        time, *own_time = predict(run, (None, rate) if rate else (None,))
        row.update(
            replayed_step_s=time.total, measured_over_replayed=run["step_s"] / time.total, replayed=time.to_dict()
        )
        if rate:
            own = own_time[0].total
            row.update(own_rate_Gps=rate / 1e9, replayed_own_step_s=own, measured_over_own=run["step_s"] / own)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| card | model | GPUs | bs | measured s | predicted then | predicted now | measured / now "
        "| now: compute / exposed transfers / GPU Adam / exposed CPU Adam "
        "| at the run's own CPU rate (G/s): measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        now = "skipped" if "skipped" in r else f"{r['replayed_step_s']:.3f}"
        ratio = "" if "skipped" in r else f"{r['measured_over_replayed']:.2f}"
        then = f"{r['predicted_step_s']:.3f}" if r.get("predicted_step_s") else "–"
        own = f"{r['measured_over_own']:.2f} ({r['own_rate_Gps']:.2f})" if r.get("measured_over_own") else "–"
        parts = "" if "skipped" in r else " / ".join(f"{r['replayed'][k]:.3f}" for k in PARTS)
        lines.append(
            f"| {r['card']} | {r['model']} | {r['gpus']} | {r['batch']} | {r['step_s']:.3f} | {then} | {now} | {ratio} "
            f"| {parts} | {own} |"
        )
    done = [r["measured_over_replayed"] for r in rows if "skipped" not in r]
    if done:
        lines.append(
            f"\n{len(done)} runs replayed; mean |measured / predicted - 1| = "
            f"{sum(abs(x - 1) for x in done) / len(done):.3f}, worst {max(done, key=lambda x: abs(x - 1)):.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", type=Path, default=[report.DEFAULT_OUT])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    runs = [
        r
        for path in args.inputs
        for r in report.load_runs(path)
        if r.get("system") in report.ELIXIR_SYSTEMS and r.get("status") == "ok"
    ]
    rows = replay(runs)
    print(json.dumps(rows, indent=1) if args.json else render(rows))


if __name__ == "__main__":
    main()
