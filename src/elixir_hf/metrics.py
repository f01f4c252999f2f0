"""``EngineMetrics``: what the engine decided and how it behaves, as ``elixir/*`` log values.

Each ``collect()`` returns the numbers since the previous one: the plan's shape (``elixir/plan_*``,
first call only) and its predictions of what is measured (``COMPARED``), loss scale, skipped steps,
GPU and host memory, the step-time breakdown and the engine's chunk traffic per optimizer step; with compiled blocks, the
compile time (the cold start), graphs and graph breaks so far (``elixir/compile_*``). ``ElixirAccelerator``
holds one per prepared engine: ``ElixirTrainer.log`` merges it into every training log (so it
reaches ``trainer_state.json``'s ``log_history`` and every reporter) and
``ElixirAccelerator.log`` into every ``accelerator.log`` call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psutil
import torch

from elixir_runtime import ElixirPlan, compile_stats

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
    Compared("forward waiting for it", "s", "elixir/update_wait_s_per_step", "elixir/plan_update_wait_s"),
    Compared("GPU peak", "GiB", "elixir/gpu_peak_gib", "elixir/plan_gpu_peak_gib", peak=True),
    Compared("host RSS / pinned shards", "GiB", "elixir/host_rss_gib", "elixir/plan_host_gib", peak=True),
)
"""What a run is held against its plan by: ``elixir-plan --run``'s rows, the reporters' grouped charts."""


class EngineMetrics:
    def __init__(self, optimizer: ElixirAcceleratedOptimizer, plan: ElixirPlan, compiled: bool = False) -> None:
        self.optimizer, self.plan, self.compiled = optimizer, plan, compiled
        self._plan_logged = False
        self._breaks_told = False
        self._since = self._now()

    def _now(self) -> tuple[float, int, dict[str, float]]:
        return time.perf_counter(), self.optimizer.steps, dict(self.optimizer.elixir_optimizer.runtime.stats)

    def collect(self) -> dict[str, float]:
        out = {} if self._plan_logged else _plan_metrics(self.plan)
        self._plan_logged = True
        out.update(_predicted(self.plan))
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


def _plan_metrics(plan: ElixirPlan) -> dict[str, float]:
    """The plan's shape (first log only)."""
    out = {
        "elixir/plan_chunks": plan.n_chunks,
        "elixir/plan_chunk_size": plan.chunk_size,
        "elixir/plan_rcache_blocks": plan.n_blocks,
        "elixir/plan_offloaded_chunks": len(plan.offload),
        "elixir/plan_device_gib": plan.device_bytes / _GIB,
    }
    rate = (plan.search.get("rates") or {}).get("cpu_update_Gps")
    if plan.predicted is not None and rate and plan.offload:  # the CPU update rate a searched plan priced
        out["elixir/plan_cpu_update_Gps"] = rate
    return out


def _predicted(plan: ElixirPlan) -> dict[str, float]:
    """The plan's predictions of ``COMPARED`` (every log): its pinned host memory; a searched plan's step, GPU
    update and, with offloaded chunks, the CPU update and the forward's wait for it; a profiled plan's GPU peak."""
    out = {"elixir/plan_host_gib": plan.host_bytes / _GIB}
    if plan.predicted is not None:
        t = plan.predicted
        out["elixir/plan_step_s"] = t.total
        out["elixir/plan_optimizer_s"] = t.gpu_adam
        if plan.offload:
            out["elixir/plan_cpu_update_s"] = t.cpu_adam
            out["elixir/plan_update_wait_s"] = t.exposed_cpu_adam
    if plan.memory.activations is not None:
        out["elixir/plan_gpu_peak_gib"] = plan.device_peak_bytes / _GIB
    return out


def _memory_metrics(device: torch.device) -> dict[str, float]:
    out = {"elixir/host_rss_gib": psutil.Process().memory_info().rss / _GIB}
    if device.type == "cuda":
        out["elixir/gpu_allocated_gib"] = torch.cuda.memory_allocated(device) / _GIB
        out["elixir/gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out
