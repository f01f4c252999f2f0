"""Updates of offloaded chunks off the training loop's thread, overlapped with the next forward.

One step's updates are slices of the offloaded chunks' shards, in the next forward's order (the
chunks the root acquires, then chunk order: ``update_order``), in one shared queue.
The CPU lane (a worker thread running the C++ kernel, which releases the GIL through ctypes)
takes slices from the front, so the chunks the next forward needs first are done first. The
device lane (``runtime/device_lane.py``: stage a slice to the GPU over the link the optimizer
phase leaves idle, update it with the GPU kernel, copy it back), when there is one, takes slices
from the back. Neither lane has a fixed share: the split balances itself at
whatever rates the two run on this machine, and each lane starts with the slice at its end, so
both work whenever there are two slices. Every slice is taken exactly once.

A gather or a gradient reduction of an offloaded chunk waits only for that chunk's slices, on
both lanes (``wait``); checkpoints and the next ``step`` wait for all (``wait_all``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..chunk.layout import GroupRange
from ..kernels.kernel import AdamHyper
from .state import ChunkState
from .stats import StatsCounter

if TYPE_CHECKING:
    import torch

__all__ = ["HostUpdates", "Lane", "SliceUpdate", "update_order"]


def update_order(chunks: Sequence[int], root: Collection[int]) -> list[int]:
    """``chunks`` (in chunk order) in the order the next forward needs them: those the root acquires
    before any unit runs (``root``), then chunk order. The engine's queue and the step model's."""
    first = set(root)
    return [c for c in chunks if c in first] + [c for c in chunks if c not in first]


@dataclass(frozen=True, eq=False)
class SliceUpdate:
    """Arena range ``[lo, hi)`` of an offloaded chunk's shard and the kernel calls that update it."""

    chunk: ChunkState
    lo: int
    hi: int
    work: list[tuple[int, list[GroupRange]]]
    """``(step count, segments)`` in arena offsets, inside ``[lo, hi)``."""
    hypers: list[AdamHyper]
    div_scale: float

    @property
    def index(self) -> int:
        return self.chunk.index

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class Lane(Protocol):
    """A second update lane: ``issue`` starts a slice's update, ``finish`` blocks until its
    results are back in host memory; up to ``depth`` slices are in flight."""

    depth: int
    numel: int
    """Elements of the largest slice it takes (the optimizer cuts offloaded chunks into slices of it)."""

    def issue(self, job: SliceUpdate) -> torch.cuda.Event | None: ...

    def finish(self, token: torch.cuda.Event | None) -> None: ...


@dataclass(eq=False)
class _Chunk:
    """One chunk's slices of a step: done when none is left."""

    left: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class HostUpdates:
    def __init__(self, stats: StatsCounter, lane: Lane | None = None) -> None:
        """``stats``: where each lane's updated elements (``updated_cpu``, ``updated_device``), the
        CPU lane's busy seconds (``cpu_update_s``) and the seconds waited for updates
        (``update_wait_s``) are counted."""
        self.lane, self.stats = lane, stats
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="elixir-update")
        self._pending: dict[int, _Chunk] = {}
        self._lock = threading.Lock()
        self.trace: list[tuple[str, int, float, float, int]] | None = None
        """When a list: every slice a lane finished as ``(lane, chunk, start, end, elements)`` and
        every wait for a chunk as ``("wait", chunk, start, end, 0)``, in ``time.perf_counter``
        seconds (``benchmarks/step_anatomy.py``)."""

    def submit(self, jobs: list[SliceUpdate], cpu: Callable[[SliceUpdate], None]) -> None:
        """Queues one step's ``jobs`` (slices in the next forward's order, each with ``index``, its
        chunk, and ``numel``); ``cpu(job)`` updates one on the CPU, the lane (if any) takes the others."""
        records: dict[int, _Chunk] = {}
        for job in jobs:
            records.setdefault(job.index, _Chunk()).left += 1
        self._pending.update(records)
        queue = deque(jobs)
        if not queue:
            return
        first = queue.popleft()
        if self.lane is not None and queue:
            self._pool.submit(self._run_lane, queue, queue.pop(), records)
        self._pool.submit(self._run_cpu, queue, first, cpu, records)

    def _run_cpu(
        self,
        queue: deque[SliceUpdate],
        job: SliceUpdate | None,
        cpu: Callable[[SliceUpdate], None],
        records: dict[int, _Chunk],
    ) -> None:
        while job is not None:
            error, start = None, time.perf_counter()
            try:
                cpu(job)
            except BaseException as exc:  # re-raised by wait() on the training loop's thread
                error = exc
            end = time.perf_counter()
            self._record("cpu", job, start, end)
            self._retire(job, "cpu", error, records, cpu_busy=end - start)
            job = _take(queue, queue.popleft)

    def _run_lane(self, queue: deque[SliceUpdate], job: SliceUpdate | None, records: dict[int, _Chunk]) -> None:
        lane = self.lane
        assert lane is not None, "submit starts this worker where there is a lane"
        in_flight: deque[tuple[SliceUpdate, torch.cuda.Event | None, float]] = deque()
        while job is not None or in_flight:
            if job is not None:
                start = time.perf_counter()
                try:
                    in_flight.append((job, lane.issue(job), start))
                except BaseException as exc:
                    self._retire(job, "device", exc, records)
                job = _take(queue, queue.pop)
            if in_flight and (job is None or len(in_flight) >= lane.depth):
                done, token, start = in_flight.popleft()
                error = None
                try:
                    lane.finish(token)
                except BaseException as exc:
                    error = exc
                self._record("device", done, start, time.perf_counter())
                self._retire(done, "device", error, records)

    def _record(self, lane: str, job: SliceUpdate, start: float, end: float) -> None:
        if self.trace is not None:  # failed slices too (the stats count only finished ones)
            self.trace.append((lane, job.index, start, end, job.numel))

    def _retire(
        self,
        job: SliceUpdate,
        lane: str,
        error: BaseException | None,
        records: dict[int, _Chunk],
        cpu_busy: float = 0.0,
    ) -> None:
        rec = records[job.index]
        if error is None:  # one call: a reader of the stats sees both or neither
            self.stats.add(**{f"updated_{lane}": job.numel}, cpu_update_s=cpu_busy)
        with self._lock:
            if error is not None and rec.error is None:
                rec.error = error
            rec.left -= 1
            if rec.left == 0:
                rec.done.set()

    def busy(self, chunk: int) -> bool:
        """Whether ``chunk``'s update is queued or running (a prefetch should not block on it)."""
        rec = self._pending.get(chunk)
        return rec is not None and not rec.done.is_set()

    def pending(self, chunk: int) -> bool:
        """Whether ``chunk`` has an update not yet waited for: unlike ``busy``, the same on every
        rank at the same point of the step (it does not depend on how fast the lanes are)."""
        return chunk in self._pending

    def wait(self, chunk: int) -> None:
        """Blocks until ``chunk``'s update is done on both lanes (re-raising an error, if any)."""
        rec = self._pending.pop(chunk, None)
        if rec is not None:
            start = time.perf_counter()
            rec.done.wait()
            end = time.perf_counter()
            self.stats.add(update_wait_s=end - start)
            if self.trace is not None:
                self.trace.append(("wait", chunk, start, end, 0))
            if rec.error is not None:
                raise rec.error

    def wait_all(self) -> None:
        for chunk in list(self._pending):
            self.wait(chunk)

    def close(self) -> None:
        """Waits for every update, then ends the worker threads (the engine is released)."""
        self.wait_all()
        self._pool.shutdown(wait=True)


def _take(queue: deque[SliceUpdate], pop: Callable[[], SliceUpdate]) -> SliceUpdate | None:
    """The next job from one end of the shared queue, ``None`` once it is empty (deque pops are atomic)."""
    try:
        return pop()
    except IndexError:
        return None
