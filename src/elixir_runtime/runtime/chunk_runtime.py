"""The chunk runtime: residency, gathers, gradient write-back and reduce-scatter.

Everything that moves chunk data lives here; the module hooks (``hooks.py``) only say *when*:

* ``acquire`` makes chunks resident in the rCache (gathering from shards, evicting the Belady
  victim) and pins them while a unit runs; ``prefetch`` gathers the next chunks of the trace
  early on a side stream;
* ``on_grad`` copies a parameter's gradient over its own slot of the gathered chunk (its data is
  no longer needed), and when every parameter of a chunk has its gradient the chunk is averaged
  over ranks by reduce-scatter into this rank's gradient shard, and its buffer is freed;
* ``finish_backward`` runs once at the end of each backward: it reduces what unused parameters
  left incomplete (their slots zero-filled, the same on every rank) so no rank ever waits on
  another. Which parameters got a gradient is recorded (``used_params``): the optimizer leaves
  the others alone, as torch's AdamW does with ``.grad is None``.

[Note: reduce order] Ranks must issue collectives in the same order. A chunk is reduced as soon as
its last gradient arrives, so, as with FSDP, every rank must run the same modules in a step (the
usual SPMD contract); chunks left incomplete by unused parameters are reduced at the end of
backward in chunk order, identical on every rank. A parameter that gets its gradient on some ranks
only can break that order (its chunk completes during backward on one rank, at its end on
another); ``used_params`` compares a fingerprint of each rank's reduce order and fails, naming the
parameter, rather than let mispaired collectives corrupt the gradients.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..chunk.collectives import Collectives
from ..chunk.layout import ChunkLayout, ChunkSpec
from ..chunk.rcache import Buffer, RCache
from ..chunk.schedule import AccessSchedule
from ..chunk.store import Residence, ShardArenas, build_arenas, grads_on_demand
from .host_updates import HostUpdates, Lane
from .lockstep import Lockstep

__all__ = ["ChunkState", "ChunkRuntime", "RCacheExhausted", "Residency"]


class Residency(enum.Enum):
    """Where the parameters a forward reads come from."""

    SHARDED = "sharded"
    """Training: each unit gathers its chunks with the other ranks (forwards are collectives)."""
    FULL = "full"
    """Inside ``full_params``: every parameter is on this rank; forwards run alone, hooks stand by."""
    ELSEWHERE = "full on rank 0 only"
    """Inside ``full_params(rank0_only=True)`` on another rank: no forward can run here."""

_FINGERPRINT_MOD = 2**61 - 1  # a prime: the reduce-order fingerprint fits an int64


class RCacheExhausted(RuntimeError):
    """Every rCache buffer holds a chunk that is in use: the plan's rCache is too small."""


@dataclass(eq=False)
class ChunkState:
    spec: ChunkSpec
    shards: ShardArenas
    """The arenas (device or host) holding this chunk's shard and optimizer states, at ``offset``."""
    offset: int
    shard_numel: int
    buffer: Buffer | None = None
    """The rCache buffer of the gathered chunk, while it has one."""
    valid: bool = False
    """The buffer holds the gathered params (some slots may already hold this backward's grads)."""
    pins: int = 0
    written: set[int] = field(default_factory=set)
    """Params whose gradient is in the buffer in the current backward."""
    reduced: bool = False
    grad_fresh: bool = True
    """The next reduce overwrites the grad shard (set by zero_grad) instead of accumulating."""
    has_grad: bool = False
    ready: torch.cuda.Event | None = None
    """Gather finished; consumed by the first use on the compute stream."""
    gathered: torch.cuda.Event | None = None
    """Last gather finished: the host shard may be rewritten after it."""
    reduced_event: torch.cuda.Event | None = None
    """Last reduction (and D2H copy) finished: the grad shard may be read after it."""
    n_grad_params: int = 0
    grad: torch.Tensor | None = None
    """This rank's reduced gradient shard: a view of the host arena for an offloaded chunk; on the
    device a tensor of its own from the chunk's first reduction of a step to ``zero_grad``."""

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def gather_source(self) -> torch.Tensor:
        """This rank's shard as gathers read it (the fp32 master where no compute-dtype copy is kept)."""
        return self.shards.source(self.offset, self.shard_numel, self.spec.trainable)

    def grad_shard(self) -> torch.Tensor:
        """The gradient shard, allocated (uninitialised) on the current stream if it has none."""
        if self.grad is None:
            self.grad = torch.empty(self.shard_numel, dtype=self.shards.param.dtype, device=self.shards.device)
        return self.grad

    @property
    def evictable(self) -> bool:
        return not self.spec.private and self.pins == 0 and not self.written


class ChunkRuntime:
    def __init__(
        self,
        layout: ChunkLayout,
        placement: list[Residence],
        n_blocks: int,
        coll: Collectives,
        device: torch.device,
        dtype: torch.dtype,
        prefetch: int,
        lockstep: Lockstep,
        weights: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
        lane: Lane | None = None,
        grads_share_activations: bool = False,
    ) -> None:
        """``weights`` maps a parameter to the full value its shards start from (``WeightSource.value``);
        ``lane``: the device lane that updates offloaded slices beside the CPU (``runtime/device_lane.py``);
        ``grads_share_activations``: the plan let the GPU's gradient shards use memory the loss's
        activations free (one micro-batch per step, ``search.memory.GradWindow``)."""
        self.warn_accumulation = grads_share_activations
        self.layout, self.coll, self.device, self.dtype = layout, coll, device, dtype
        self.lockstep = lockstep
        self.residency = Residency.SHARDED
        self.prefetch_depth = prefetch
        self.cuda = device.type == "cuda"
        self.arenas = build_arenas(layout, placement, coll.rank, device, dtype, weights)
        self.rcache = RCache(n_blocks, layout.block_numel, dtype, device)
        self._buffer_by_ptr = {b.data.data_ptr(): b for b in self.rcache.buffers}
        self.chunks = [
            ChunkState(
                spec,
                self.arenas[placement[spec.index]],
                self.arenas[placement[spec.index]].offsets[spec.index],
                layout.shard_numel(spec),
                n_grad_params=len(spec.slots) if spec.trainable else 0,
            )
            for spec in layout.chunks
        ]
        for c in self.chunks:
            if c.spec.private:
                c.buffer = self.rcache.private_buffer(c.spec.numel, dtype, device)
            if c.spec.trainable and not grads_on_demand(c.shards.placement):
                c.grad = c.shards.grad[c.offset : c.offset + c.shard_numel]
        self.trainable = [c for c in self.chunks if c.spec.trainable]
        self._norm_parts: list[torch.Tensor] = []
        """Per-chunk grad norms taken on the device right after each fresh reduction."""
        self._norm_from_shards = False
        self.schedule = AccessSchedule()
        self._resident: dict[int, ChunkState] = {}
        self.fetch_stream = torch.cuda.Stream(device) if self.cuda else None
        self.reduce_stream = torch.cuda.Stream(device) if self.cuda else None
        zero = torch.zeros((), dtype=dtype, device=device)
        self._placeholders = [zero.expand(p.shape) for p in layout.params]
        self.stats = {"gathers": 0, "prefetches": 0, "evictions": 0, "reduces": 0, "updated_cpu": 0, "updated_device": 0}
        """Counters since prepare, for logging and tests (``updated_*``: offloaded elements each update lane updated)."""
        self.host_updates = HostUpdates(lane, self.stats)
        self.in_backward = False
        self.backward_pending = False
        """A grad-enabled forward ran whose backward has not been finished yet."""
        self.on_finish_backward: list = []
        self.got_grad = [False] * len(layout.params)
        """Params that received a gradient on this rank since the last ``zero_grad``."""
        self.trainable_params = [i for i, g in enumerate(layout.groups) if g >= 0]
        """Indices of the parameters the optimizer updates."""
        self._missing: torch.Tensor | None = None
        """Set by ``grad_norm_sq`` on several ranks: how many (rank, parameter) pairs got no gradient."""
        self._reduce_order = 0
        """Fingerprint of this rank's sequence of chunk reductions since the last ``zero_grad``."""
        for i, p in enumerate(layout.params):
            p.data = self._placeholders[i]

    # ------------------------------------------------------------------ residency
    def acquire(self, ids: tuple[int, ...], pin: bool) -> None:
        """Makes chunks ``ids`` resident for the current stream; pins them if ``pin``."""
        for i in ids:
            self.schedule.access(i)
        for i in ids:
            c = self.chunks[i]
            c.pins += 1  # protects it while the others are gathered
            if not c.valid:
                self._gather(c)
        for i in ids:
            c = self.chunks[i]
            if not pin:
                c.pins -= 1
            if c.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(c.ready)
                c.ready = None
        self.prefetch()

    def release(self, ids: tuple[int, ...]) -> None:
        for i in ids:
            c = self.chunks[i]
            assert c.pins > 0, f"chunk {i} released more often than acquired"
            c.pins -= 1

    def ensure_resident(self, i: int) -> ChunkState:
        c = self.chunks[i]
        if not c.valid:
            self.acquire((i,), pin=False)
        return c

    def buffer_of(self, t: torch.Tensor) -> Buffer | None:
        """The rCache buffer ``t``'s storage belongs to (``None`` for anything else)."""
        return self._buffer_by_ptr.get(t.untyped_storage().data_ptr())

    def prefetch(self) -> None:
        if self.prefetch_depth == 0:
            return
        fetched = scanned = 0
        for i, distance in self.schedule.upcoming():
            scanned += 1
            if fetched >= self.prefetch_depth or scanned > self.prefetch_depth + 16:
                return
            c = self.chunks[i]
            if c.valid:
                continue
            if self._update_in_the_way(i) or not (c.spec.private or self._has_buffer_for(distance)):
                return  # never block the training loop on a prefetch (a private chunk has its own buffer)
            self._gather(c)
            self.stats["prefetches"] += 1
            fetched += 1

    def _update_in_the_way(self, i: int) -> bool:
        """Whether prefetching chunk ``i`` would wait on its CPU update. With several ranks a
        prefetch is a collective, so the answer must not depend on timing: any update not yet
        waited for counts. Alone, only one still running does."""
        if self.coll.world_size > 1:
            return self.host_updates.pending(i)
        return self.host_updates.busy(i)

    def _has_buffer_for(self, distance: int) -> bool:
        if self.rcache.free:
            return True
        victim = self._victim()
        return victim is not None and self.schedule.eviction_score(victim.index) > distance

    def _victim(self) -> ChunkState | None:
        candidates = [c for c in self._resident.values() if c.evictable]
        return max(candidates, key=lambda c: self.schedule.eviction_score(c.index), default=None)

    def _take_buffer(self) -> Buffer:
        if self.rcache.free:
            return self.rcache.free.pop()
        victim = self._victim()
        if victim is None:
            raise RCacheExhausted(
                f"all {len(self.rcache.buffers)} rCache blocks hold chunks in use "
                f"({sorted(self._resident)}); use a larger n_blocks"
            )
        self._drop(victim)
        self.stats["evictions"] += 1
        return self.rcache.free.pop()

    def _gather(self, c: ChunkState) -> None:
        if c.buffer is None:
            c.buffer = self._take_buffer()
            c.buffer.chunk = c.index
            self._resident[c.index] = c
        full = c.buffer.data[: c.spec.numel]
        self.stats["gathers"] += 1
        with self._on(self.fetch_stream, c.buffer):
            self.fill(c, full)
            if self.cuda:
                c.ready = torch.cuda.Event()
                c.ready.record(self.fetch_stream)
                c.gathered = c.ready
        c.valid = True
        self.show_params(c, full)

    def fill(self, c: ChunkState, full: torch.Tensor) -> None:
        """Gathers chunk ``c`` from every rank's shard into ``full`` (a collective, on the current stream)."""
        self.host_updates.wait(c.index)
        self.coll.shard_of(full).copy_(c.gather_source, non_blocking=True)
        self.coll.all_gather_(full)

    def show_params(self, c: ChunkState, full: torch.Tensor) -> None:
        """Points the parameters of ``c`` at their slots in the gathered buffer ``full``."""
        for s in c.spec.slots:
            self.layout.params[s.param].data = full[s.offset : s.offset + s.numel].view(self._placeholders[s.param].shape)

    def hide_params(self, c: ChunkState) -> None:
        """Points the parameters of ``c`` back at their zero-stride placeholders."""
        for s in c.spec.slots:
            self.layout.params[s.param].data = self._placeholders[s.param]

    def _drop(self, c: ChunkState, event: torch.cuda.Event | None = None) -> None:
        """Forgets the gathered params of ``c``; a public buffer goes back to the free list."""
        self.hide_params(c)
        c.valid = False
        buffer = c.buffer
        assert buffer is not None
        if self.cuda:
            if event is None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            buffer.free_event = event
        if not buffer.private:
            buffer.chunk = None
            c.buffer = None
            del self._resident[c.index]
            self.rcache.free.append(buffer)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None, buffer: Buffer | None):
        """Runs on ``stream`` after the current stream's work and the buffer's last user."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if buffer is not None and buffer.free_event is not None:
            stream.wait_event(buffer.free_event)
        with torch.cuda.stream(stream):
            yield

    # ------------------------------------------------------------------ gradients
    def note_grad_forward(self) -> None:
        """A grad-enabled forward ran: its backward is pending. Warns, once, when the last
        backward's gradient shards are still on the GPU under a plan for one micro-batch per step:
        that plan let them use memory the activations now need too (``search/memory.py``)."""
        if not self.backward_pending and self.warn_accumulation:
            held = sum(c.grad.numel() * c.grad.element_size() for c in self.trainable
                       if c.has_grad and c.grad is not None and grads_on_demand(c.shards.placement))
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
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    @torch.no_grad()
    def on_grad(self, param_index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: the grad overwrites the param's slot in its chunk."""
        self.begin_backward()
        c = self.chunks[self.layout.param_chunk[param_index]]
        if c.reduced:
            raise RuntimeError(
                f"parameter {self.layout.names[param_index][0]!r} received a gradient after its chunk was "
                "reduced in this backward; is it used outside the module that owns it?"
            )
        self.ensure_resident(c.index)
        s = self.layout.param_slot[param_index]
        slot = c.buffer.data[s.offset : s.offset + s.numel]
        grad = param.grad.reshape(-1)
        if param_index in c.written:
            slot.add_(grad)
        else:
            slot.copy_(grad)
            c.written.add(param_index)
        param.grad = None
        self.got_grad[param_index] = True
        if len(c.written) == c.n_grad_params:
            self._reduce(c)

    def _reduce(self, c: ChunkState, written: bool = True) -> None:
        """Averages the chunk's gradients over ranks into its grad shard and frees its buffer.
        ``written=False``: this rank has no gradient for the chunk and contributes zeros from a
        temporary buffer (no gather, and the rCache buffer, if any, keeps its params)."""
        self.host_updates.wait(c.index)  # its CPU update still reads the grad shard
        self._reduce_order = (self._reduce_order * 1_000_003 + c.index + 1) % _FINGERPRINT_MOD
        buffer = c.buffer if written else None
        event = None
        dst = c.grad_shard()  # allocated on the compute stream, which frees it (zero_grad)
        if self.cuda and dst.is_cuda:
            dst.record_stream(self.reduce_stream)
        with self._on(self.reduce_stream, buffer):
            if buffer is None:
                full = torch.zeros(c.spec.numel, dtype=self.dtype, device=self.device)
            else:
                full = buffer.data[: c.spec.numel]
            shard = self.coll.reduce_scatter_avg_(full)
            if c.grad_fresh:
                self._norm_parts.append(torch.linalg.vector_norm(shard, dtype=torch.float32))
                dst.copy_(shard, non_blocking=True)
            else:  # accumulated on its own device: the norm is taken from the shards at the end
                self._norm_from_shards = True
                dst.add_(shard.to(dst.device))
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.reduce_stream)
                c.reduced_event = event
        c.grad_fresh = False
        c.has_grad = True
        c.reduced = True
        self.stats["reduces"] += 1
        if buffer is not None:
            c.written.clear()
            self._drop(c, event)

    @torch.no_grad()
    def finish_backward(self) -> None:
        """End of backward: reduce every chunk not reduced yet, in chunk order, on every rank."""
        for hook in self.on_finish_backward:
            hook()
        for c in self.trainable:
            if c.reduced:
                continue
            if c.written:  # some params got no grad this step: their slots must not add to the sum
                for s in c.spec.slots:
                    if s.param not in c.written:
                        c.buffer.data[s.offset : s.offset + s.numel].zero_()
                self._reduce(c)
            elif self.coll.world_size > 1:  # collectives must match across ranks
                self._reduce(c, written=False)
            elif c.grad_fresh:
                self.host_updates.wait(c.index)  # the last step's CPU update may still read it
                c.grad_shard().zero_()
                c.grad_fresh = False
                c.has_grad = True
        for c in self.trainable:
            c.reduced = False
        self.in_backward = False
        self.backward_pending = False

    # ------------------------------------------------------------------ optimizer side
    def wait_for_grads(self) -> None:
        """Host-side wait for in-flight reductions, gathers and CPU updates (checkpoints, tests)."""
        self.host_updates.wait_all()
        if self.cuda:
            self.reduce_stream.synchronize()
            self.fetch_stream.synchronize()

    def device_grads_ready(self) -> None:
        """Makes the compute stream wait for reductions and gathers (no host sync): updates follow."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.reduce_stream)
            torch.cuda.current_stream(self.device).wait_stream(self.fetch_stream)

    @staticmethod
    def wait_host_chunk(c: ChunkState) -> None:
        """Before a CPU update of ``c``: its grads have landed and no gather still reads its shard."""
        for event in (c.reduced_event, c.gathered):
            if event is not None:
                event.synchronize()

    @property
    def has_grads(self) -> bool:
        return any(c.has_grad for c in self.trainable)

    def zero_grad(self) -> None:
        """Forgets the gradients; frees the device's gradient shards (the next backward allocates
        them again), whose memory the next forward's activations then use."""
        for c in self.trainable:
            c.grad_fresh = True
            c.has_grad = False
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
        ranks only can break.
        """
        if self.coll.world_size == 1:
            return list(self.got_grad)
        missing, self._missing = self._missing, None  # this step's answer only
        if missing is not None and missing.item() == 0:
            return [g >= 0 for g in self.layout.groups]  # every trainable one, everywhere
        local = torch.tensor(self.got_grad, dtype=torch.int64)
        order = torch.tensor([self._reduce_order], dtype=torch.int64)
        flags = torch.cat([local, -local, order, -order]).to(self.device)
        self.coll.all_reduce_max_(flags)
        flags = flags.tolist()
        n = len(self.got_grad)
        anywhere, everywhere = flags[:n], [-f for f in flags[n : 2 * n]]
        if flags[2 * n] != -flags[2 * n + 1]:
            some = [self.layout.names[i][0] for i in range(n) if anywhere[i] and not everywhere[i]]
            raise RuntimeError(
                f"the ranks reduced gradient chunks in different orders this step because parameters {some[:5]} "
                "got a gradient on some ranks only and their chunks completed at different points of the backward; "
                "the gradients are not usable. Give those parameters a gradient on every rank (e.g. add "
                "0 * their output to the loss, which makes their gradient zero rather than absent)"
            )
        return [bool(f) for f in anywhere]

    def invalidate_trainable(self) -> None:
        """After an update the gathered copies of trainable chunks are stale."""
        for c in self.trainable:
            if c.valid:
                assert c.pins == 0, "optimizer step while a chunk is in use"
                self._drop(c)

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squared grads over all chunks and ranks, fp32, on the compute device.

        Normally summed from the norms taken at each reduction (no pass over host memory, no
        host sync here); after accumulating micro-steps, from the grad shards themselves.
        """
        if self._norm_from_shards:
            self.wait_for_grads()
            parts = [torch.linalg.vector_norm(c.grad, dtype=torch.float32).to(self.device) for c in self.trainable if c.has_grad]
        else:
            self.device_grads_ready()
            parts = self._norm_parts
        total = torch.stack(parts).square().sum() if parts else torch.zeros((), device=self.device)
        if self.coll.world_size == 1:
            return total
        # the same all-reduce counts the parameters some rank got no gradient for (see used_params)
        missing = sum(not self.got_grad[i] for i in self.trainable_params)
        both = torch.stack([total, torch.tensor(float(missing), device=self.device)])
        self.coll.all_reduce_sum_(both)
        self._missing = both[1]
        return both[0]

    @torch.no_grad()
    def reload_shards(self) -> None:
        """After master/frozen shards were overwritten (checkpoint load): recast and drop stale buffers."""
        self.wait_for_grads()
        for a in self.arenas.values():
            if a.param_copy is not None:
                a.param_copy.copy_(a.master)
        for c in self.chunks:
            if c.valid:
                assert c.pins == 0, "checkpoint load while a chunk is in use"
                self._drop(c)
