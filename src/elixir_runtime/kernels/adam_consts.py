"""Per-group, per-step Adam constants shared by the C++ and Triton kernels.

Both kernels take the same constants, computed here in double and rounded to fp32 by the kernel,
so they run the same fp32 math and agree with each other bit for bit on IEEE hardware.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .kernel import AdamHyper

__all__ = ["CONST_NAMES", "step_constants"]

CONST_NAMES = ("step_size", "inv_bc2_sqrt", "omb1", "beta2", "omb2", "eps", "decay_mul", "l2", "grad_mul")
"""The order of each group's constants (the C ``Group`` struct and the Triton table's columns)."""


def step_constants(hypers: Sequence[AdamHyper], step: int, div_scale: float) -> list[tuple[float, ...]]:
    """One tuple per group, in CONST_NAMES order: bias corrections folded into the lr and the
    second-moment scale, AdamW decay as a multiplier, Adam's L2 as a grad term, 1/div_scale."""
    if step < 1 or div_scale <= 0.0:
        raise ValueError("step is 1-based and div_scale must be positive")
    out: list[tuple[float, ...]] = []
    for h in hypers:
        out.append(
            (
                h.lr / (1.0 - h.beta1**step),
                1.0 / math.sqrt(1.0 - h.beta2**step),
                1.0 - h.beta1,
                h.beta2,
                1.0 - h.beta2,
                h.eps,
                1.0 - h.lr * h.weight_decay if h.decoupled else 1.0,
                0.0 if h.decoupled else h.weight_decay,
                1.0 / div_scale,
            )
        )
    return out
