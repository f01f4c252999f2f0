"""Gradients: write-back into gathered chunks, reduce-scatter into shards, end of backward, norm.

``ChunkGradients`` moves every trainable chunk's ``GradState`` (``state.py``):

* ``on_grad`` copies a parameter's gradient over its own slot of the gathered chunk (its data is
  no longer needed): ``EMPTY -> WRITING`` or ``HELD -> ACCUMULATING``. When every parameter of
  the chunk has its gradient the chunk is averaged over ranks by reduce-scatter into this rank's
  gradient shard (overwriting it from ``WRITING``, adding to it from ``ACCUMULATING``) and its
  buffer is freed: ``-> REDUCED``;
* ``finish_backward`` runs once at the end of each backward: it reduces what unused parameters
  left incomplete (their slots zero-filled, the same on every rank) so no rank ever waits on
  another, then ``REDUCED -> HELD``. Which parameters got a gradient is recorded
  (``used_params``): the optimizer leaves the others alone, as torch's AdamW does with ``.grad is None``;
* ``zero_grad``: ``HELD -> EMPTY``; the device's gradient shards are freed.

[Note: reduce order] Ranks must issue collectives in the same order. A chunk is reduced as soon as
its last gradient arrives, so, as with FSDP, every rank must run the same modules in a step (the
usual SPMD contract); chunks left incomplete by unused parameters are reduced at the end of
backward in chunk order, identical on every rank. A parameter that gets its gradient on some ranks
only can break that order (its chunk completes during backward on one rank, at its end on
another); ``used_params`` compares a fingerprint of each rank's reduce order and fails, naming the
parameter, rather than let mispaired collectives corrupt the gradients.

[Note: the norm] The step's gradient norm is summed from norms taken on the device right after
each chunk's first (overwriting) reduction of a step, so it needs no pass over host memory; once
a chunk has accumulated a second micro-step its norm is taken from the shards at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..chunk.layout import ChunkLayout
from ..chunk.store import grads_on_demand
from .context import EngineContext
from .gathers import ChunkGathers, on_stream
from .host_updates import HostUpdates
from .phase import Phase
from .state import ChunkState, GradState

__all__ = ["ChunkGradients"]

_FINGERPRINT_MOD = 2**61 - 1  # a prime: the reduce-order fingerprint fits an int64


class ChunkGradients:
    def __init__(
        self,
        ctx: EngineContext,
        layout: ChunkLayout,
        chunks: list[ChunkState],
        gathers: ChunkGathers,
        host_updates: HostUpdates,
        warn_accumulation: bool,
    ) -> None:
        """``warn_accumulation``: the plan let the GPU's gradient shards use memory the loss's
        activations free (one micro-batch per step, ``search.memory.GradWindow``)."""
        self.ctx, self.layout, self.chunks, self.gathers = ctx, layout, chunks, gathers
        self.host_updates, self.warn_accumulation = host_updates, warn_accumulation
        self.reduce_stream = torch.cuda.Stream(ctx.device) if ctx.cuda else None
        self.trainable = [c for c in chunks if c.spec.trainable]
        self.trainable_params = [i for i, g in enumerate(layout.groups) if g >= 0]
        """Indices of the parameters the optimizer updates."""
        self.backward_pending = False
        """A grad-enabled forward ran whose backward has not been finished yet."""
        self.on_finish_backward: list[Callable[[], None]] = []
        """Called first at the end of each backward (the units' post-backward: unpins)."""
        self.got_grad = [False] * len(layout.params)
        """Params that received a gradient on this rank since the last ``zero_grad``."""
        self._norm_parts: list[torch.Tensor] = []
        """Per-chunk grad norms taken on the device right after each fresh reduction ([Note: the norm])."""
        self._norm_from_shards = False
        self._missing: torch.Tensor | None = None
        """Set by ``grad_norm_sq`` on several ranks: how many (rank, parameter) pairs got no gradient."""
        self._reduce_order = 0
        """Fingerprint of this rank's sequence of chunk reductions since the last ``zero_grad``."""

    # ------------------------------------------------------------------ backward
    def note_grad_forward(self) -> None:
        """A grad-enabled forward ran: its backward is pending. Warns, once, when the last
        backward's gradient shards are still on the GPU under a plan for one micro-batch per step:
        that plan let them use memory the activations now need too (``search/memory.py``)."""
        if not self.backward_pending and self.warn_accumulation:
            held = sum(
                c.grad.numel() * c.grad.element_size()
                for c in self.trainable
                if c.has_grad and c.grad is not None and grads_on_demand(c.shards.placement)
            )
            if held:
                self.warn_accumulation = False
                warnings.warn(
                    f"elixir: a forward started with {held / 2**30:.2f} GiB of the last backward's gradients still on "
                    "the GPU (gradient accumulation, or no zero_grad() after step()), but the plan was made for one "
                    "micro-batch per step (ElixirConfig.grad_accum_steps=1), which lets those gradients use memory "
                    "the activations need: the step may run out of GPU memory. Set ElixirConfig(grad_accum_steps=N) "
                    "to plan for N micro-batches per step",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.backward_pending = True

    def begin_backward(self) -> None:
        if self.ctx.phase.now is not Phase.BACKWARD:
            self.ctx.phase.to(Phase.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    @torch.no_grad()
    def on_grad(self, param_index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: the grad overwrites (or adds to) the param's slot in its chunk."""
        self.begin_backward()
        c = self.chunks[self.layout.param_chunk[param_index]]
        if c.grad_state is GradState.REDUCED:
            raise RuntimeError(
                f"parameter {self.layout.names[param_index][0]!r} received a gradient after its chunk was "
                "reduced in this backward; is it used outside the module that owns it?"
            )
        self.gathers.ensure_gathered(c.index)
        s = self.layout.param_slot[param_index]
        assert c.buffer is not None and param.grad is not None, "a gathered chunk; the hook of an accumulated grad"
        slot = c.buffer.data[s.offset : s.offset + s.numel]
        grad = param.grad.reshape(-1)
        if param_index in c.written:
            slot.add_(grad)
        else:
            if not c.written:
                c.transition(GradState.ACCUMULATING if c.has_grad else GradState.WRITING)
            slot.copy_(grad)
            c.written.add(param_index)
        param.grad = None
        self.got_grad[param_index] = True
        if len(c.written) == c.n_grad_params:
            self._reduce(c)

    def _reduce(self, c: ChunkState, written: bool = True) -> None:
        """``-> REDUCED``: averages the chunk's gradients over ranks into its grad shard and frees
        its buffer. ``written=False``: this rank has no gradient for the chunk and contributes zeros
        from a temporary buffer (no gather, and the rCache buffer, if any, keeps its params)."""
        self.host_updates.wait(c.index)  # its CPU update still reads the grad shard
        self._reduce_order = (self._reduce_order * 1_000_003 + c.index + 1) % _FINGERPRINT_MOD
        buffer = c.buffer if written else None
        event = None
        dst = c.grad_shard()  # allocated on the compute stream, which frees it (zero_grad)
        if self.reduce_stream is not None and dst.is_cuda:
            dst.record_stream(self.reduce_stream)
        with on_stream(self.reduce_stream, buffer, self.ctx.device):
            if buffer is None:
                full = torch.zeros(c.spec.numel, dtype=self.ctx.dtype, device=self.ctx.device)
            else:
                full = buffer.data[: c.spec.numel]
            shard = self.ctx.coll.reduce_scatter_avg_(full)
            if not c.has_grad:  # the first reduction since zero_grad overwrites
                self._norm_parts.append(torch.linalg.vector_norm(shard, dtype=torch.float32))
                dst.copy_(shard, non_blocking=True)
            else:  # accumulated on its own device: the norm is taken from the shards at the end
                self._norm_from_shards = True
                dst.add_(shard.to(dst.device))
            if self.ctx.cuda:
                event = torch.cuda.Event()
                event.record(self.reduce_stream)
                c.reduced_event = event
        c.written.clear()
        c.transition(GradState.REDUCED)
        self.ctx.stats.add(reduces=1)
        if buffer is not None:
            self.gathers.drop(c, event)

    @torch.no_grad()
    def finish_backward(self) -> None:
        """End of backward: reduce every chunk not reduced yet, in chunk order, on every rank."""
        for hook in self.on_finish_backward:
            hook()
        for c in self.trainable:
            if c.grad_state is GradState.REDUCED:
                continue
            if c.written:  # some params got no grad this step: their slots must not add to the sum
                assert c.buffer is not None, "gradients are written into a gathered buffer"
                for s in c.spec.slots:
                    if s.param not in c.written:
                        c.buffer.data[s.offset : s.offset + s.numel].zero_()
                self._reduce(c)
            elif self.ctx.coll.world_size > 1:  # collectives must match across ranks
                self._reduce(c, written=False)
            elif c.grad_state is GradState.EMPTY:
                self.host_updates.wait(c.index)  # the last step's CPU update may still read it
                c.grad_shard().zero_()
                c.transition(GradState.HELD)
        for c in self.trainable:
            if c.grad_state is GradState.REDUCED:
                c.transition(GradState.HELD)
        if self.ctx.phase.now is Phase.BACKWARD:  # not when called for a backward that reached no hook
            self.ctx.phase.to(Phase.IDLE)
        self.backward_pending = False

    # ------------------------------------------------------------------ step
    @property
    def has_grads(self) -> bool:
        return any(c.has_grad for c in self.trainable)

    def zero_grad(self) -> None:
        """Forgets the gradients; frees the device's gradient shards (the next backward allocates
        them again), whose memory the next forward's activations then use."""
        for c in self.trainable:
            if c.grad_state is GradState.ACCUMULATING:  # inside a backward: illegal, raises when checked
                c.transition(GradState.WRITING)
            elif c.grad_state is not GradState.EMPTY and c.grad_state is not GradState.WRITING:
                c.transition(GradState.EMPTY)
            if grads_on_demand(c.shards.placement):
                c.grad = None
        self._norm_parts = []
        self._norm_from_shards = False
        self.got_grad = [False] * len(self.layout.params)
        self._reduce_order = 0
        self._missing = None

    def used_params(self) -> list[bool]:
        """Per parameter: whether it received a gradient since ``zero_grad`` on any rank (DDP's
        ``find_unused_parameters`` rule: a parameter used on some ranks only is averaged with
        zeros from the others and updated; one used on none is left alone).

        With several ranks: nothing more when the step's norm all-reduce (``grad_norm_sq``) found
        every parameter used on every rank (the usual case); otherwise one small all-reduce (MAX of
        the flags, their negation and the reduce-order fingerprint) and a host sync, which also
        checks that every rank reduced the chunks in the same order, as a parameter used on some
        ranks only can break ([Note: reduce order]).
        """
        if self.ctx.coll.world_size == 1:
            return list(self.got_grad)
        missing, self._missing = self._missing, None  # this step's answer only
        if missing is not None and missing.item() == 0:
            return [g >= 0 for g in self.layout.groups]  # every trainable one, everywhere
        local = torch.tensor(self.got_grad, dtype=torch.int64)
        order = torch.tensor([self._reduce_order], dtype=torch.int64)
        flags = torch.cat([local, -local, order, -order]).to(self.ctx.device)
        self.ctx.coll.all_reduce_max_(flags)
        maxed: list[int] = flags.tolist()
        n = len(self.got_grad)
        anywhere, everywhere = maxed[:n], [-f for f in maxed[n : 2 * n]]
        if maxed[2 * n] != -maxed[2 * n + 1]:
            some = [self.layout.names[i][0] for i in range(n) if anywhere[i] and not everywhere[i]]
            raise RuntimeError(
                f"the ranks reduced gradient chunks in different orders this step because parameters {some[:5]} "
                "got a gradient on some ranks only and their chunks completed at different points of the backward; "
                "the gradients are not usable. Give those parameters a gradient on every rank (e.g. add "
                "0 * their output to the loss, which makes their gradient zero rather than absent)"
            )
        return [bool(f) for f in anywhere]

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squared grads over all chunks and ranks, fp32, on the compute device.

        Normally summed from the norms taken at each reduction (no pass over host memory, no
        host sync here); after accumulating micro-steps, from the grad shards themselves
        ([Note: the norm]).
        """
        if self._norm_from_shards:
            self.wait_for_grads()
            parts = [
                torch.linalg.vector_norm(c.grad, dtype=torch.float32).to(self.ctx.device)
                for c in self.trainable
                if c.has_grad
            ]
        else:
            self.device_grads_ready()
            parts = self._norm_parts
        total = torch.stack(parts).square().sum() if parts else torch.zeros((), device=self.ctx.device)
        if self.ctx.coll.world_size == 1:
            return total
        # the same all-reduce counts the parameters some rank got no gradient for (see used_params)
        missing = sum(not self.got_grad[i] for i in self.trainable_params)
        both = torch.stack([total, torch.tensor(float(missing), device=self.ctx.device)])
        self.ctx.coll.all_reduce_sum_(both)
        self._missing = both[1]
        return both[0]

    def wait_for_grads(self) -> None:
        """Host-side wait for in-flight reductions, gathers and CPU updates (checkpoints, tests)."""
        self.host_updates.wait_all()
        for stream in (self.reduce_stream, self.gathers.fetch_stream):  # CUDA only
            if stream is not None:
                stream.synchronize()

    def device_grads_ready(self) -> None:
        """Makes the compute stream wait for reductions and gathers (no host sync): updates follow."""
        for stream in (self.reduce_stream, self.gathers.fetch_stream):  # CUDA only
            if stream is not None:
                torch.cuda.current_stream(self.ctx.device).wait_stream(stream)

    @staticmethod
    def wait_host_chunk(c: ChunkState) -> None:
        """Before a CPU update of ``c``: its grads have landed and no gather still reads its shard."""
        for event in (c.reduced_event, c.gathered):
            if event is not None:
                event.synchronize()
