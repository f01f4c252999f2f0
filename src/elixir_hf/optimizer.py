"""``ElixirAcceleratedOptimizer``: what Accelerate and the Trainer hold as "the optimizer".

It is an ``AcceleratedOptimizer`` (so ``accelerator.optimizer_step_was_skipped``, schedulers and
``save_state`` treat it like any other) without the two stock behaviours that break the engine:
no device placement round-trip of the state (the shards live where the plan put them), and no
GradScaler (the engine scales fp16 losses itself). ``step`` runs the ``ElixirOptimizer``'s fused
unscale + clip + Adam and then clears the gradient shards, because the Trainer only calls
``model.zero_grad()``, which cannot see them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from accelerate.optimizer import AcceleratedOptimizer

from elixir_runtime import ElixirOptimizer

from .timing import StepTimer

__all__ = ["ElixirAcceleratedOptimizer"]


class ElixirAcceleratedOptimizer(AcceleratedOptimizer):  # type: ignore[misc]  # accelerate ships no types: AcceleratedOptimizer is Any
    def __init__(self, optimizer: ElixirOptimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.timer = StepTimer(optimizer.runtime.device)
        self.skipped_steps = 0
        self.steps = 0  # optimizer steps run, skipped ones included (as the Trainer's global_step counts them)

    @property
    def elixir_optimizer(self) -> ElixirOptimizer:
        """The ``ElixirOptimizer`` it wraps: ``backward``, ``clip_grad_norm``, ``no_sync``, ``loss_scale``."""
        return cast(ElixirOptimizer, self.optimizer)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self.gradient_state.sync_gradients:
            return None
        with self.timer("optimizer"):
            loss: float | None = self.optimizer.step(closure)
            self.optimizer.zero_grad()
        self.steps += 1
        self.skipped_steps += int(self.optimizer.step_was_skipped)
        return loss

    @property
    def step_was_skipped(self) -> bool:
        return self.elixir_optimizer.step_was_skipped
