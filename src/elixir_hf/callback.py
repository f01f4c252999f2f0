"""``ElixirCallback``: what the engine decided and how it behaves, in the Trainer's own logs.

* before training: the plan as a table on the console (rank 0), and its key numbers as
  ``elixir/plan_*`` values in the first log;
* at every training log step, into the same ``logs`` dict every reporter receives (TensorBoard,
  W&B, console): loss scale, skipped steps, GPU and host memory, the step-time breakdown and the
  engine's chunk traffic per step. The callback must run before the reporters;
  ``ElixirTrainer`` puts it first;
* with every checkpoint: ``elixir_plan.json`` (the plan plus the model it was made for), which
  ``--elixir path/to/elixir_plan.json`` reuses.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psutil
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoint import PLAN_NAME, atomic_write_text
from .optimizer import ElixirAcceleratedOptimizer
from .plugin import describe_model

__all__ = ["ElixirCallback"]

_GIB = 2**30


class ElixirCallback(TrainerCallback):
    def __init__(self) -> None:
        self._since: tuple[float, int, dict[str, int]] | None = None
        self._plan_logged = False

    def on_train_begin(self, args, state, control, model=None, **kwargs: Any) -> None:
        elixir = getattr(model, "_elixir", None)
        if elixir is None:
            return
        if state.is_world_process_zero:
            m = describe_model(model)
            print(
                f"Elixir plan for {m['class']} ({m['parameters'] / 1e6:.1f}M parameters):\n{elixir.plan.table()}",
                flush=True,
            )
        self._since = (time.perf_counter(), state.global_step, dict(elixir.runtime.stats))

    def on_log(self, args, state, control, logs=None, model=None, optimizer=None, **kwargs: Any) -> None:
        elixir = getattr(model, "_elixir", None)
        if elixir is None or not isinstance(optimizer, ElixirAcceleratedOptimizer) or "loss" not in (logs or {}):
            return
        if not self._plan_logged:
            logs.update(_plan_metrics(elixir.plan))
            self._plan_logged = True
        logs["elixir/loss_scale"] = optimizer.engine.loss_scale
        logs["elixir/skipped_steps"] = optimizer.skipped_steps
        logs.update(_memory_metrics(elixir.runtime.device))
        logs.update(self._rates(state.global_step, optimizer, dict(elixir.runtime.stats)))

    def _rates(self, step: int, optimizer: ElixirAcceleratedOptimizer, stats: dict[str, int]) -> dict[str, float]:
        """Per-optimizer-step averages since the previous log: seconds per phase, chunk traffic."""
        phases = optimizer.timer.collect()  # synchronizes CUDA, so the wall time below is settled too
        now = time.perf_counter()
        t0, step0, stats0 = self._since or (now, step, stats)
        self._since = (now, step, stats)
        steps = max(step - step0, 1)
        wall = (now - t0) / steps
        out = {
            "elixir/step_s": wall,
            "elixir/backward_s": phases.get("backward", 0.0) / steps,
            "elixir/optimizer_s": phases.get("optimizer", 0.0) / steps,
        }
        out["elixir/forward_other_s"] = max(wall - out["elixir/backward_s"] - out["elixir/optimizer_s"], 0.0)
        out.update({f"elixir/{k}_per_step": (v - stats0.get(k, 0)) / steps for k, v in stats.items()})
        return out

    def on_save(self, args, state, control, model=None, **kwargs: Any) -> None:
        elixir = getattr(model, "_elixir", None)
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if elixir is None or not state.is_world_process_zero or not os.path.isdir(folder):
            return
        record = {**json.loads(elixir.plan.to_json()), "model": describe_model(model)}
        atomic_write_text(json.dumps(record, indent=2), os.path.join(folder, PLAN_NAME))


def _plan_metrics(plan) -> dict[str, float]:
    return {
        "elixir/plan_chunks": plan.n_chunks,
        "elixir/plan_chunk_size": plan.chunk_size,
        "elixir/plan_rcache_blocks": plan.n_blocks,
        "elixir/plan_offloaded_chunks": len(plan.offload),
        "elixir/plan_device_gib": plan.device_bytes / _GIB,
        "elixir/plan_host_gib": plan.host_bytes / _GIB,
    }


def _memory_metrics(device: torch.device) -> dict[str, float]:
    out = {"elixir/host_rss_gib": psutil.Process().memory_info().rss / _GIB}
    if device.type == "cuda":
        out["elixir/gpu_allocated_gib"] = torch.cuda.memory_allocated(device) / _GIB
        out["elixir/gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out
