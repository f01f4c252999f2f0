"""The batch shape a plan was made for, and what a larger training batch meets: the run goes on
where the plan's memory provably holds it, else the batch is refused before its forward.

The planner profiles one example batch; its activations are what the plan budgets. A later
micro-batch with more tokens (batch x sequence) needs more activation memory than planned, which
on a tight plan is an out-of-memory error in the middle of a step. The root's pre-forward hook
(``hooks.py``) puts each training forward's ``(batch, seq)`` into the lockstep check-in every
forward makes (``distributed/lockstep.py``) and hands every rank's to ``BatchGuard.check``, so that
every rank decides from the same numbers: the largest of them either fits the plan's budget by
``estimated_activations`` (logged once) or is refused on every rank with ``BatchShapeError``, naming
both shapes, the estimated and budgeted GiB and the fixes. A plan without a profile and budget (a
static plan, a plan file from before them) has nothing to estimate from: a larger batch warns once.

[Note: the estimate of a larger batch]
The profile gives the activation peak ``A`` of the planned ``(b, s)``. Its parts grow at most as
``b·s²``: constant (gradients awaiting their chunk), linear in tokens (held block inputs under
checkpointing, one block's recompute, the logits and loss, fused attention's output and
log-sum-exp), quadratic in the sequence (a materialised ``s x s`` mask or eager/math attention's
scores, per row of the batch). So with ``t = b'·s' / (b·s)`` and ``r = s' / s``,

    A' = A · max(1, t, t·r)

bounds every part of the peak of ``(b', s')`` from above. Linear in tokens alone is not a bound:
on the tiny test model the profile's peak for twice the sequence is 2.3x (CPU) to 3.0x (CUDA
kernels), for eight times 15x to 21x (``tests/elixir_runtime/runtime/test_batch_guard.py``); large models'
peaks are nearer linear, so the bound is loose for them, and a batch much longer than planned is
refused rather than guessed at. The batch holds when the plan's GPU arenas still fit its budget
with ``A'`` in place of ``A`` (``search/budget.py``): ``device ≤ F_alloc·(capacity − buffers −
F_frag·A')``. The gradient shards' credit for activations freed in backward (``device_grads``)
is the plan's, made for the smaller batch, whose backward frees less: kept, it errs safe.

[Note: no re-plan mid-run]
A larger batch is not re-planned: the plan fixed the chunk layout, the arenas (allocated once,
filled, the optimizer's state in them) and which shards live on the GPU; changing any of them
mid-run means moving every offloaded shard and its Adam state, on every rank at the same step, and
the new plan could as well not fit. The plan is therefore made for the largest shape the run can
know before it starts (``elixir_hf.batch_plan``), and a batch beyond it is let through only where
the plan provably holds it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import PlanError
from ..host import size_text

__all__ = ["BatchGuard", "BatchShapeError", "estimated_activations", "token_shape"]

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


class BatchShapeError(PlanError):
    """A training batch larger than the plan's ``batch_shape`` whose activations the plan cannot hold;
    raised on every rank before the forward."""


def estimated_activations(peak: int, planned: tuple[int, int], shape: tuple[int, int]) -> int:
    """An upper bound on the activation peak of ``shape`` from ``peak``, profiled at ``planned``
    ([Note: the estimate of a larger batch])."""
    (b, s), (pb, ps) = shape, planned
    tokens, longer = b * s / (pb * ps), s / ps
    return math.ceil(peak * max(1.0, tokens, tokens * longer))


class BatchGuard:
    """Judges training micro-batches with more tokens than ``planned`` (batch, seq): they go on if
    ``activations`` (the profiled peak at ``planned``) scaled to them fits ``room`` (the most activation
    bytes the plan's budget holds, ``ElixirPlan.activation_room``), else ``BatchShapeError``; without
    both numbers, a warning once. The plan's guard: ``ElixirPlan.batch_guard``."""

    def __init__(
        self, planned: tuple[int, int] | list[int] | None, activations: int | None = None, room: int | None = None
    ) -> None:
        self.planned = (int(planned[0]), int(planned[1])) if planned else None
        self.activations, self.room = activations, room
        self.warned = False
        self.held = 0
        """Tokens of the largest batch beyond the plan let through (logged once, at the first)."""

    def check(self, shapes: list[tuple[int, int] | None]) -> None:
        """``shapes``: every rank's training batch, by rank (one entry: a single process). The same
        on every rank, so every rank decides alike."""
        if self.planned is None:
            return
        pb, ps = self.planned
        beyond = [(r, sh) for r, sh in enumerate(shapes) if sh is not None and sh[0] * sh[1] > pb * ps]
        if not beyond:
            return
        if self.activations is None or self.room is None:
            self._warn(max(beyond, key=lambda x: x[1][0] * x[1][1])[1])
            return
        estimates = [(estimated_activations(self.activations, self.planned, sh), r, sh) for r, sh in beyond]
        estimate, rank, (b, s) = max(estimates)
        if estimate > self.room:
            whose = f"rank {rank}'s" if len(shapes) > 1 else "this"
            raise BatchShapeError(
                f"elixir: {whose} training batch is {b} x {s} = {b * s} tokens per micro-batch, more than the "
                f"{pb} x {ps} = {pb * ps} the plan was made for (its batch_shape): its activations are estimated at "
                f"up to {size_text(estimate)} (the profiled {size_text(self.activations)} x max(1, tokens ratio, "
                f"tokens ratio x sequence ratio)), and the plan's GPU budget holds {size_text(self.room)} of "
                "activations, so it would run out of GPU memory; refused before its forward, on every rank. Fix: "
                "cap the length batches are padded or cut to (max_length, max_seq_length, block_size) at the "
                f"planned {ps}, or plan for this shape (elixir-plan --batch-size {b} --seq-len {s} --json > "
                "plan.json, then --elixir plan.json), or give the planner this longer example batch"
            )
        if self.held == 0:
            logger.info(
                "elixir: a training batch of %d x %d = %d tokens per micro-batch is beyond the plan's batch_shape "
                "%d x %d, and its activations (estimated at up to %s) still fit the plan's budget (%s): it runs. "
                "Logged once.",
                b,
                s,
                b * s,
                pb,
                ps,
                size_text(estimate),
                size_text(self.room),
            )
        self.held = max(self.held, b * s)

    def _warn(self, shape: tuple[int, int]) -> None:
        if self.warned:
            return
        self.warned = True
        (b, s), (pb, ps) = shape, self.planned or shape
        logger.warning(
            "elixir: this training batch is %d x %d = %d tokens per micro-batch, more than the %d x %d = %d the plan "
            "was made for (its batch_shape): its activations were not budgeted (a plan without a profiled budget) "
            "and the GPU may run out of memory. Set the length batches are padded or cut to (max_length, "
            "block_size, max_seq_length), or plan for this shape (elixir-plan --batch-size %d --seq-len %d --json "
            "> plan.json) and pass that plan with --elixir plan.json. Warned once.",
            b,
            s,
            b * s,
            pb,
            ps,
            pb * ps,
            b,
            s,
        )
