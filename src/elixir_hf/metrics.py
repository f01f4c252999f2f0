"""``EngineMetrics``: what the engine decided and how it behaves, as ``elixir/*`` log values.

Each ``collect()`` returns the numbers since the previous one: the plan's key numbers
(``elixir/plan_*``, ``plan_view.plan_metrics``: all of them in the first call, in every call those
that predict a measured value, ``COMPARED``), loss scale, skipped steps, GPU and host memory, the
step-time breakdown and the engine's chunk traffic per optimizer step; with compiled blocks, the
compile time (the cold start), graphs and graph breaks so far (``elixir/compile_*``). ``ElixirAccelerator``
holds one per prepared engine: ``ElixirTrainer.log`` merges it into every training log (so it
reaches ``trainer_state.json``'s ``log_history`` and every reporter) and
``ElixirAccelerator.log`` into every ``accelerator.log`` call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psutil
import torch

from elixir_runtime import ElixirPlan, compile_stats
from elixir_runtime.plan_view import plan_metrics

from .optimizer import ElixirAcceleratedOptimizer

__all__ = ["COMPARED", "Compared", "EngineMetrics"]

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True)
class Compared:
    """A measured ``elixir/*`` value and the plan's prediction of it, logged side by side."""

    label: str
    unit: str
    run: str
    """The measured key."""
    plan: str
    """The predicted key (in every log, with ``run``: a flat line beside it in a reporter's chart)."""
    peak: bool = False
    """Over a run: the highest logged value (memory), else the median of the logs after the first (times)."""


COMPARED = (
    Compared("step time", "s", "elixir/step_s", "elixir/plan_step_s"),
    Compared("optimizer step", "s", "elixir/optimizer_s", "elixir/plan_optimizer_s"),
    Compared("CPU update of offloaded chunks", "s", "elixir/cpu_update_s_per_step", "elixir/plan_cpu_update_s"),
    Compared("forward waiting for it (GPU idle)", "s", "elixir/update_stall_s_per_step", "elixir/plan_update_wait_s"),
    Compared("GPU peak", "GiB", "elixir/gpu_peak_gib", "elixir/plan_gpu_peak_gib", peak=True),
    Compared("host RSS / pinned shards", "GiB", "elixir/host_rss_gib", "elixir/plan_host_gib", peak=True),
)
"""What a run is held against its plan by: ``elixir-plan --run``'s rows, the reporters' grouped charts."""
_PREDICTIONS = frozenset(c.plan for c in COMPARED)


class EngineMetrics:
    def __init__(self, optimizer: ElixirAcceleratedOptimizer, plan: ElixirPlan, compiled: bool = False) -> None:
        self.optimizer, self.plan, self.compiled = optimizer, plan, compiled
        self._plan_logged = False
        self._breaks_told = False
        self._since = self._now()

    def _now(self) -> tuple[float, int, dict[str, float]]:
        return time.perf_counter(), self.optimizer.steps, dict(self.optimizer.elixir_optimizer.runtime.stats)

    def collect(self) -> dict[str, float]:
        out = _predicted(self.plan) if self._plan_logged else _plan_metrics(self.plan)
        self._plan_logged = True
        out["elixir/loss_scale"] = self.optimizer.elixir_optimizer.loss_scale
        out["elixir/skipped_steps"] = self.optimizer.skipped_steps
        out.update(_memory_metrics(self.optimizer.elixir_optimizer.runtime.device))
        out.update(self._rates())
        if self.compiled:  # compile_blocks ran: dynamo's totals in this process so far
            stats = compile_stats()
            out.update(
                {
                    "elixir/compile_s": stats.compile_s,
                    "elixir/compile_graphs": stats.graphs,
                    "elixir/compile_graph_breaks": stats.graph_breaks,
                }
            )
            if stats.graph_breaks and not self._breaks_told:
                self._breaks_told = True
                reasons = "; ".join(f"{reason} ({n}x)" for reason, n in stats.break_reasons.items())
                logger.warning(
                    "elixir: torch.compile broke the compiled decoder layers %d times, each break running the rest "
                    "of the layer eagerly, which costs more than compiling gains where the break is a fused kernel "
                    "dynamo cannot trace (Liger's, with use_liger_kernel): keep one of torch_compile and the kernels "
                    "(docs/hf.md, --torch_compile). Reasons: %s",
                    stats.graph_breaks,
                    reasons,
                )
        return out

    def _rates(self) -> dict[str, float]:
        """Per-optimizer-step averages since the previous call: seconds per phase, chunk traffic."""
        phases = self.optimizer.timer.collect()  # synchronizes CUDA, so the wall time below is settled too
        (t0, step0, stats0), (now, step, stats) = self._since, self._now()
        self._since = (now, step, stats)
        steps = max(step - step0, 1)
        wall = (now - t0) / steps
        out = {
            "elixir/step_s": wall,
            "elixir/backward_s": phases.get("backward", 0.0) / steps,
            "elixir/optimizer_s": phases.get("optimizer", 0.0) / steps,
        }
        out["elixir/forward_other_s"] = max(wall - out["elixir/backward_s"] - out["elixir/optimizer_s"], 0.0)
        delta = {k: v - stats0.get(k, 0) for k, v in stats.items()}
        out.update({f"elixir/{k}_per_step": v / steps for k, v in delta.items()})
        if delta.get("cpu_update_s"):
            out["elixir/cpu_update_Gps"] = delta["updated_cpu"] / delta["cpu_update_s"] / 1e9
        return out


def once_only(logs: Mapping[str, object]) -> set[str]:
    """The keys of ``logs`` a run logs in its first log only: the plan's shape (``elixir/plan_*``
    but its predictions, which every log carries). A resumed run logs none of them again."""
    return {k for k in logs if k.startswith("elixir/plan_") and k not in _PREDICTIONS}


def _plan_metrics(plan: ElixirPlan) -> dict[str, float]:
    """The plan's key numbers, as the plan's renderer gives them (``plan_view.plan_metrics``)."""
    return {f"elixir/{k}": v for k, v in plan_metrics(plan).items()}


def _predicted(plan: ElixirPlan) -> dict[str, float]:
    """Those of the plan's numbers that predict a measured one (``COMPARED``): in every log, beside it."""
    return {k: v for k, v in _plan_metrics(plan).items() if k in _PREDICTIONS}


def _memory_metrics(device: torch.device) -> dict[str, float]:
    out = {"elixir/host_rss_gib": psutil.Process().memory_info().rss / _GIB}
    if device.type == "cuda":
        out["elixir/gpu_allocated_gib"] = torch.cuda.memory_allocated(device) / _GIB
        out["elixir/gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out
