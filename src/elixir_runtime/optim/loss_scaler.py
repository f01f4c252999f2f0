"""Dynamic loss scaling for fp16 (bf16 and fp32 use a constant scale of 1)."""

from __future__ import annotations

from ..config import LossScaleConfig

__all__ = ["LossScaler"]


class LossScaler:
    def __init__(self, config: LossScaleConfig, enabled: bool) -> None:
        self.config, self.enabled = config, enabled
        self.scale = config.init_scale if enabled else 1.0
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        """Backs off on overflow; grows after ``growth_interval`` clean steps in a row."""
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.config.growth_interval == 0:
            self.scale *= self.config.growth_factor

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
