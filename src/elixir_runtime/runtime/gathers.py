"""Gathers: which chunks are gathered into rCache buffers, and when.

``ChunkGathers`` moves every chunk's ``ParamState`` (``state.py``); the module hooks say when:

* ``acquire`` makes chunks gathered for the compute stream (gathering those that are not,
  evicting the Belady victim for a buffer) and pins them while a unit runs; ``release`` unpins;
  where the compute stream waits for a gather (and for a CPU update before it), ``stalls`` times
  the GPU's idle (``StallClock``);
* ``prefetch`` gathers the next chunks of the recorded trace early on the fetch stream
  (``RELEASED -> GATHERING``), never waiting for a buffer or a CPU update to do so;
* ``drop`` releases a chunk (after its reduction, on eviction, when a step or a load makes its
  gathered copy stale): its parameters point at placeholders again and a public buffer is free.

Contracts: a gather is a collective, so every rank gathers the same chunks in the same order
(prefetch decisions depend only on the trace and on state that is the same on every rank). A
buffer is reused only after its last user's event (``Buffer.free_event``). A gather of a shard on
the GPU follows the compute stream's work so far; one of an offloaded shard on one rank only the
buffer's last user ([Note: uploads ahead of compute]). The compute stream waits for a chunk's gather
(``ready``) before its first use: the ``GATHERING -> GATHERED`` step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..chunk.layout import ChunkLayout
from ..chunk.rcache import Buffer, RCache
from ..chunk.schedule import AccessSchedule
from .context import EngineContext
from .host_updates import HostUpdates
from .stalls import StallClock
from .state import ChunkState, ParamState

__all__ = ["ChunkGathers", "RCacheExhausted", "on_stream"]


class RCacheExhausted(RuntimeError):
    """Every rCache buffer holds a chunk that is in use: the plan's rCache is too small."""


@contextlib.contextmanager
def on_stream(
    stream: torch.cuda.Stream | None, buffer: Buffer | None, device: torch.device, after_compute: bool = True
) -> Iterator[None]:
    """Runs on ``stream`` after the buffer's last user and, if ``after_compute``, after the current
    stream's work so far (inline on CPU)."""
    if stream is None:
        yield
        return
    if after_compute:
        stream.wait_stream(torch.cuda.current_stream(device))
    if buffer is not None and buffer.free_event is not None:
        stream.wait_event(buffer.free_event)
    with torch.cuda.stream(stream):
        yield


class ChunkGathers:
    def __init__(
        self,
        ctx: EngineContext,
        layout: ChunkLayout,
        chunks: list[ChunkState],
        rcache: RCache,
        prefetch: int,
        host_updates: HostUpdates,
    ) -> None:
        self.ctx, self.layout, self.chunks, self.rcache = ctx, layout, chunks, rcache
        self.prefetch_depth, self.host_updates = prefetch, host_updates
        self.fetch_stream = torch.cuda.Stream(ctx.device) if ctx.cuda else None
        self.stalls = StallClock(ctx.stats, ctx.cuda)
        self.schedule = AccessSchedule()
        self._gathered: dict[int, ChunkState] = {}
        """Public chunks holding an rCache buffer (``GATHERING`` or ``GATHERED``)."""
        self._buffer_by_ptr = {b.data.data_ptr(): b for b in rcache.buffers}
        zero = torch.zeros((), dtype=ctx.dtype, device=ctx.device)
        self.placeholder_ptr = zero.data_ptr()
        """The one storage every placeholder is a view of (``runtime/hooks.py``, [Note: placeholder reads])."""
        self._placeholders = [zero.expand(p.shape) for p in layout.params]
        for i, p in enumerate(layout.params):
            p.data = self._placeholders[i]

    def acquire(self, ids: tuple[int, ...], pin: bool) -> None:
        """Makes chunks ``ids`` gathered for the current stream; pins them if ``pin``."""
        for i in ids:
            self.schedule.access(i)
        update = any(not self.chunks[i].valid and self.host_updates.pending(i) for i in ids)
        waits = update or any(self.chunks[i].param_state is not ParamState.GATHERED for i in ids)
        mark = self.stalls.start() if waits else None  # [Note: GPU stalls] in stalls.py
        for i in ids:
            c = self.chunks[i]
            c.pins += 1  # protects it while the others are gathered
            if not c.valid:
                self._gather(c)
        for i in ids:
            c = self.chunks[i]
            if not pin:
                c.pins -= 1
            if c.param_state is ParamState.GATHERING:
                self._use(c)
        if mark is not None:
            self.stalls.stop(mark, "update_stall_s" if update else "gather_stall_s")
        self.prefetch()

    def release(self, ids: tuple[int, ...]) -> None:
        for i in ids:
            c = self.chunks[i]
            assert c.pins > 0, f"chunk {i} released more often than acquired"
            c.pins -= 1

    def ensure_gathered(self, i: int) -> ChunkState:
        """Chunk ``i`` gathered for the current stream, not pinned (saved-tensor unpacks, gradients)."""
        c = self.chunks[i]
        if not c.valid:
            self.acquire((i,), pin=False)
        elif c.param_state is ParamState.GATHERING:  # prefetched: its gather may still be running
            self._use(c)
        return c

    def _use(self, c: ChunkState) -> None:
        """``GATHERING -> GATHERED``: the current stream waits for the chunk's gather."""
        if c.ready is not None:
            torch.cuda.current_stream(self.ctx.device).wait_event(c.ready)
            c.ready = None
        c.transition(ParamState.GATHERED)

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
            self.ctx.stats.add(prefetches=1)
            fetched += 1

    def _update_in_the_way(self, i: int) -> bool:
        """Whether prefetching chunk ``i`` would wait on its CPU update. With several ranks a
        prefetch is a collective, so the answer must not depend on timing: any update not yet
        waited for counts. Alone, only one still running does."""
        if self.ctx.coll.world_size > 1:
            return self.host_updates.pending(i)
        return self.host_updates.busy(i)

    def _has_buffer_for(self, distance: int) -> bool:
        if self.rcache.free:
            return True
        victim = self._victim()
        return victim is not None and self.schedule.eviction_score(victim.index) > distance

    def _victim(self) -> ChunkState | None:
        candidates = [c for c in self._gathered.values() if c.evictable]
        return max(candidates, key=lambda c: self.schedule.eviction_score(c.index), default=None)

    def _take_buffer(self) -> Buffer:
        if self.rcache.free:
            return self.rcache.free.pop()
        victim = self._victim()
        if victim is None:
            raise RCacheExhausted(
                f"all {len(self.rcache.buffers)} rCache blocks hold chunks in use "
                f"({sorted(self._gathered)}); use a larger n_blocks"
            )
        self.drop(victim)
        self.ctx.stats.add(evictions=1)
        return self.rcache.free.pop()

    def _gather(self, c: ChunkState) -> None:
        """``RELEASED -> GATHERING``: all-gathers ``c`` into a buffer on the fetch stream."""
        if c.buffer is None:
            c.buffer = self._take_buffer()
            c.buffer.chunk = c.index
            self._gathered[c.index] = c
        full = c.buffer.data[: c.spec.numel]
        self.ctx.stats.add(gathers=1)
        # [Note: uploads ahead of compute] A shard on the GPU is written by the compute stream (the
        # optimizer step, a load), so its gather follows that stream's work so far. An offloaded
        # shard is written only on the host (the CPU lane, the device lane's copy back, a load),
        # each waited for by the host before this gather is issued (``fill``), and the buffer's last
        # user is its ``free_event``: its upload need not wait for the compute queued before it.
        # The loop's thread runs ahead of the GPU, so the upload then overlaps the compute instead
        # of starting when the GPU reaches the point where it was issued. With several ranks the
        # gather is also an all-gather beside the reductions on one communicator: those keep the
        # old order until a multi-GPU run has checked the new one (docs/architecture.md, "Streams").
        ahead = c.shards.placement == "host" and self.ctx.coll.world_size == 1
        with on_stream(self.fetch_stream, c.buffer, self.ctx.device, after_compute=not ahead):
            self.fill(c, full)
            if self.ctx.cuda:
                c.ready = torch.cuda.Event()
                c.ready.record(self.fetch_stream)
                c.gathered = c.ready
        c.transition(ParamState.GATHERING)
        self.show_params(c, full)

    def fill(self, c: ChunkState, full: torch.Tensor) -> None:
        """Gathers chunk ``c`` from every rank's shard into ``full`` (a collective, on the current stream)."""
        self.host_updates.wait(c.index)
        self.ctx.coll.shard_of(full).copy_(c.gather_source, non_blocking=True)
        self.ctx.coll.all_gather_(full)

    def show_params(self, c: ChunkState, full: torch.Tensor) -> None:
        """Points the parameters of ``c`` at their slots in the gathered buffer ``full``."""
        for s in c.spec.slots:
            self.layout.params[s.param].data = full[s.offset : s.offset + s.numel].view(
                self._placeholders[s.param].shape
            )

    def hide_params(self, c: ChunkState) -> None:
        """Points the parameters of ``c`` back at their zero-stride placeholders."""
        for s in c.spec.slots:
            self.layout.params[s.param].data = self._placeholders[s.param]

    def drop(self, c: ChunkState, event: torch.cuda.Event | None = None) -> None:
        """``-> RELEASED``: forgets the gathered params of ``c``; a public buffer goes back to the
        free list, reusable after ``event`` (default: the current stream's work so far)."""
        self.hide_params(c)
        c.transition(ParamState.RELEASED)
        buffer = c.buffer
        assert buffer is not None
        if self.ctx.cuda:
            if event is None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.ctx.device))
            buffer.free_event = event
        if not buffer.private:
            buffer.chunk = None
            c.buffer = None
            del self._gathered[c.index]
            self.rcache.free.append(buffer)

    def drop_all(self, chunks: list[ChunkState], why: str) -> None:
        """Releases every gathered chunk of ``chunks`` (their copies are stale); none may be in use."""
        for c in chunks:
            if c.valid:
                assert c.pins == 0, f"{why} while a chunk is in use"
                self.drop(c)
