"""The batch shape a plan was made for, and the warning when a training batch is larger.

The planner profiles one example batch; its activations are what the plan budgets. A later
micro-batch with more tokens (batch x sequence) needs more activation memory than planned, which
on a tight plan is an out-of-memory error hours into a run. The root's pre-forward hook
(``hooks.py``) hands each training forward's inputs to ``BatchGuard.check``, which warns once,
loudly, naming both shapes and the fix.

[Note: no re-plan mid-run]
A larger batch is not re-planned: the plan fixed the chunk layout, the arenas (allocated once,
filled, the optimizer's state in them) and which shards live on the GPU; changing any of them
mid-run means moving every offloaded shard and its Adam state, on every rank at the same step, and
the new plan could as well not fit. The plan is therefore made for the largest shape the run can
know before it starts (``elixir_hf.batch_plan``), and a batch beyond it is told, not absorbed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BatchGuard", "token_shape"]

logger = logging.getLogger(__name__)

TOKEN_KEYS = ("input_ids", "inputs_embeds")


def token_shape(args: Any, kwargs: Mapping[str, Any] | None = None) -> tuple[int, int] | None:
    """``(batch, seq)`` of a forward's inputs: ``input_ids`` (or ``inputs_embeds``) among the keyword
    arguments, else the first tensor of two or more dimensions; ``args`` may itself be a batch (a
    mapping). ``None`` where there is none."""
    if isinstance(args, Mapping):
        args, kwargs = (), args
    elif isinstance(args, torch.Tensor):
        args = (args,)
    kwargs = kwargs or {}
    for key in TOKEN_KEYS:
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    return None


class BatchGuard:
    """Warns once when a training micro-batch has more tokens than ``planned`` (batch, seq)."""

    def __init__(self, planned: tuple[int, int] | list[int] | None) -> None:
        self.planned = tuple(planned) if planned else None
        self.warned = False

    def check(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if self.planned is None or self.warned:
            return
        shape = token_shape(args, kwargs)
        if shape is None or shape[0] * shape[1] <= self.planned[0] * self.planned[1]:
            return
        self.warned = True
        (b, s), (pb, ps) = shape, self.planned
        logger.warning(
            "elixir: this training batch is %d x %d = %d tokens per micro-batch, more than the %d x %d = %d the plan "
            "was made for (its batch_shape): its activations were not budgeted and the GPU may run out of memory. "
            "Set the length batches are padded or cut to (max_length, block_size, max_seq_length), or plan for "
            "this shape (elixir-plan --batch-size %d --seq-len %d --json > plan.json) and pass that plan with "
            "--elixir plan.json. Warned once.",
            b,
            s,
            b * s,
            pb,
            ps,
            pb * ps,
            b,
            s,
        )
