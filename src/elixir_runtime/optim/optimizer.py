"""``ElixirOptimizer``: the user's Adam/AdamW, run over chunk shards.

It shares the user's ``param_groups`` dicts, so hyperparameters (and a scheduler's LR changes)
are read at every step; the per-parameter state lives in the chunk arenas instead of ``state``.
One step: one host sync for the global grad norm (clipping, and the non-finite check below), then
one kernel call per GPU-resident chunk and per slice of an offloaded one, with loss-unscaling and
clipping fused into ``div_scale``.

As in ``torch.optim.AdamW``, a parameter without a gradient in a step (no rank's backward reached
it, in any micro-step) is not touched: no decay, no moment update, and its own step count (bias
correction) does not advance. Each parameter keeps its step count; while every parameter has a
gradient and the same count (the usual case) a placement is one kernel call over the static
per-group segments; otherwise the used parameters' ranges are grouped by step count, one call each.

A step whose gradient norm is not finite is skipped on every rank (the norm is all-reduced, so
all ranks agree): in fp16 that is the loss scaler's overflow (the scale backs off), in bf16/fp32 a
NaN/inf loss or gradient, which would otherwise turn every weight it reaches into NaN for the rest
of the run. ``max_consecutive_skips`` skips in a row stop training with an error.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..chunk.layout import GroupRange
from ..chunk.store import shard_overlap
from ..config import LossScaleConfig
from ..distributed import heartbeat
from ..kernels.kernel import AdamHyper
from ..kernels.select import select_kernel
from ..runtime.chunk_runtime import ChunkRuntime, ChunkState
from ..runtime.device_lane import slice_updates
from ..runtime.host_updates import SliceUpdate
from ..runtime.update_rate import UpdateRateProbe
from . import named_state
from .loss_scaler import LossScaler

__all__ = ["ElixirOptimizer"]


class ElixirOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        user_optimizer: torch.optim.Optimizer,
        runtime: ChunkRuntime,
        *,
        decoupled: bool,
        loss_scale: LossScaleConfig,
        cpu_threads: int | None = None,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int = 25,
        rate_probe: UpdateRateProbe | None = None,
    ) -> None:
        super().__init__(user_optimizer.param_groups, user_optimizer.defaults)
        self.runtime = runtime
        self.decoupled = decoupled
        self.scaler = LossScaler(loss_scale, enabled=runtime.dtype == torch.float16)
        self.step_count = 0
        """Optimizer steps taken (skipped ones not counted)."""
        self.param_steps = [0] * len(runtime.layout.params)
        """Each parameter's own Adam step count (torch's ``state[p]["step"]``): steps it had a gradient in."""
        self.step_was_skipped = False
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self._norm: float | None = None
        self._clip_coef = 1.0
        self.cpu_threads = cpu_threads
        """OpenMP threads of the CPU Adam (``None``: ``torch.get_num_threads()``)."""
        self.rate_probe = rate_probe
        """Takes the CPU lane's rate in the first steps ([Note: the run's own rate])."""
        self._synced_updates = False
        """The updates last submitted run after a host sync (the gradient norm was taken)."""
        self.kernels = {name: select_kernel(a.device, cpu_threads) for name, a in runtime.arenas.items()}
        self._chunk_segments = {
            c.index: [s for s in c.shards.segments if c.offset <= s.offset < c.offset + c.shard_numel]
            for c in runtime.trainable
        }
        self._pieces = {c.index: _param_pieces(runtime, c) for c in runtime.trainable}

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with loss scaling; grads end up reduced in this rank's shards."""
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward(**kwargs)
        except torch.OutOfMemoryError as err:
            ctx = self.runtime.ctx
            if ctx.memory is not None:
                ctx.memory.annotate(err, "backward", ctx.device)
            raise
        if self.runtime.grads.backward_pending:
            self.runtime.grads.finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted where DDP/Accelerate code expects it; accumulation stays exact without it.

        Each chunk's gradient is reduce-scattered into this rank's shard as soon as it is complete
        and the next micro-step's gradient is added to that shard. Skipping the reduction would
        need a full-size gradient buffer per chunk, the very memory sharding saves, so the
        collectives run every micro-step (as DeepSpeed ZeRO-2/3 do).
        """
        yield

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) grads over all chunks and ranks; one host sync, cached."""
        if self._norm is None:
            self._norm = math.sqrt(self.runtime.grads.grad_norm_sq().item()) / self.scaler.scale
        return self._norm

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_``; the scaling itself is fused into the next step."""
        if norm_type != 2.0:
            raise NotImplementedError(f"only the L2 norm is supported, got norm_type={norm_type}")
        norm = self.grad_norm()
        if math.isfinite(norm):
            self._clip_coef = min(1.0, max_norm / (norm + 1e-6))
        return torch.tensor(norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every shard from the gradients reduced since ``zero_grad``.

        Call between backwards (not inside one: no chunk may be pinned). Waits for the previous
        step's CPU updates; no gradient since ``zero_grad`` is a no-op; a non-finite norm skips the
        step on every rank (``step_was_skipped``). Device shards are updated on the compute stream
        before it returns; offloaded ones are queued to the update lanes, and a gather, reduction,
        ``step`` or ``state_dict`` of a chunk waits for its slices. The gathered copies of trainable
        chunks are released (stale); gradients are kept until ``zero_grad``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.runtime.host_updates.wait_all()  # the previous step's CPU updates
        if self.rate_probe is not None:
            self.rate_probe.step_done(self._synced_updates)
            self._synced_updates = False
        self.runtime.grads.device_grads_ready()
        self.step_was_skipped = False
        if not self.runtime.grads.has_grads:
            return loss
        if (self.scaler.enabled or self.skip_nonfinite) and not math.isfinite(self.grad_norm()):
            self._skip()
            return loss
        used = self.runtime.grads.used_params()  # after the norm, whose all-reduce usually answers it
        self.consecutive_skips = 0
        self.step_count += 1
        trainable = self.runtime.grads.trainable_params
        for i in trainable:
            self.param_steps[i] += used[i]
        counts = {self.param_steps[i] for i in trainable}
        uniform = next(iter(counts)) if len(counts) == 1 and all(used[i] for i in trainable) else None
        hypers = [self._hyper(g) for g in self.param_groups]
        div_scale = self.scaler.scale / self._clip_coef
        updates = self.runtime.host_updates
        jobs = []
        for c in self.runtime.update_order:  # the order the next forward needs them
            work = self._work([c], self._chunk_segments[c.index], used, uniform)
            if c.shards.placement == "device":
                self._update(c, c.offset, c.offset + c.shard_numel, work, hypers, div_scale)
            else:
                size = updates.lane.numel if updates.lane is not None else c.shard_numel
                jobs += slice_updates(c, work, hypers, div_scale, size)
        self._synced_updates = self._norm is not None
        updates.submit(jobs, self._update_slice)
        self.scaler.update(overflow=False)
        self.runtime.invalidate_trainable()
        self._reset_norm()
        return loss

    def _skip(self) -> None:
        """A non-finite gradient norm: no update on any rank; fp16's loss scale backs off."""
        self.step_was_skipped = True
        self.consecutive_skips += 1
        norm = self.grad_norm()
        self.scaler.update(overflow=True)
        self._reset_norm()
        cause = f"the loss scale backs off to {self.scaler.scale:g}" if self.scaler.enabled else "weights unchanged"
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"elixir: {self.consecutive_skips} optimizer steps in a row had a non-finite gradient norm "
                f"({norm}) and were skipped (ElixirConfig.max_consecutive_skips={self.max_consecutive_skips}); training stopped. "
                "Look for a NaN/inf loss (bad data, a learning rate too high, fp16 overflow at the minimum loss "
                "scale), or raise max_consecutive_skips if these skips are expected"
            )
        warnings.warn(
            f"elixir: skipped optimizer step {self.step_count + 1}: the gradient norm is {norm} ({cause}; "
            f"{self.consecutive_skips} in a row, training stops at {self.max_consecutive_skips})",
            RuntimeWarning,
            stacklevel=5,  # the caller of step (through torch's no_grad and optimizer-hook wrappers)
        )

    def _work(
        self, chunks: list[ChunkState], static: list[GroupRange], used: list[bool], uniform: int | None
    ) -> list[tuple[int, list[GroupRange]]]:
        """``(step count, segments)`` kernel calls that update ``chunks``: their static per-group
        segments when every parameter was used and all share step count ``uniform``, else the
        used parameters' ranges (neighbours of one group and count merged) grouped by count."""
        if uniform is not None:
            return [(uniform, static)]
        by_step: dict[int, list[GroupRange]] = {}
        for c in chunks:
            last = None
            for offset, length, param, group in self._pieces[c.index]:
                if not used[param]:
                    last = None
                    continue
                step = self.param_steps[param]
                segs = by_step.setdefault(step, [])
                if last == (step, group):  # the previous piece: extend over the padding between them
                    segs[-1] = GroupRange(segs[-1].offset, offset + length - segs[-1].offset, group)
                else:
                    segs.append(GroupRange(offset, length, group))
                last = (step, group)
        return sorted(by_step.items())

    def _update_slice(self, job: SliceUpdate) -> None:
        """The CPU lane's update of one slice of an offloaded chunk (``runtime/host_updates.py``)."""
        self.runtime.grads.wait_host_chunk(job.chunk)
        self._update(job.chunk, job.lo, job.hi, job.work, job.hypers, job.div_scale)

    def _update(
        self,
        c: ChunkState,
        lo: int,
        hi: int,
        work: list[tuple[int, list[GroupRange]]],
        hypers: list[AdamHyper],
        div_scale: float,
    ) -> None:
        """The kernel calls of ``work`` (segments in arena offsets inside ``[lo, hi)``) on that
        range of chunk ``c``'s shard: the kernels see the range as their whole arena."""
        a = c.shards
        param_out = None if a.param_copy is None else a.param_copy[lo:hi]
        assert c.grad is not None, "finish_backward gave every trainable chunk its gradient shard"
        grad = c.grad[lo - c.offset : hi - c.offset]
        kernel, state = self.kernels[a.placement], a.state.range(lo, hi)
        for step, segments in work:
            local = [GroupRange(s.offset - lo, s.length, s.group) for s in segments]
            kernel.step(state, grad, param_out, local, hypers, step, div_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.grads.zero_grad()
        self._reset_norm()
        heartbeat.step_ended()  # armed from the step's first check-in until here (distributed/heartbeat.py)

    def _reset_norm(self) -> None:
        self._norm = None
        self._clip_coef = 1.0

    def _hyper(self, group: dict[str, Any]) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", self.decoupled)),
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state by parameter name: the steps, param groups and loss scale, and the pieces of
        each parameter's state this rank holds (copies; its kinds: ``adam_state.py``); ``named_state.py``."""
        return named_state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a ``state_dict()`` into this run's shards, whatever layout or placement saved it, where its
        pieces hold this rank's; a per-rank shard of elixir-hf 0.1.0 is refused naming the fix."""
        named_state.load_state_dict(self, state_dict)


def _param_pieces(runtime: ChunkRuntime, c: ChunkState) -> list[tuple[int, int, int, int]]:
    """``(arena offset, length, param, group)`` of each parameter's part of this rank's shard of
    chunk ``c``, in arena order."""
    layout, rank = runtime.layout, runtime.coll.rank
    out = []
    for slot in c.spec.slots:
        part = shard_overlap(layout, c.spec, slot, rank)
        if part is not None:
            out.append((c.offset + part[0], part[2], slot.param, layout.groups[slot.param]))
    return sorted(out)
