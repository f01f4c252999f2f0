"""``StallClock``: how long the compute stream stands idle at acquires that wait for a gather.

The loop's thread runs ahead of the GPU, so the seconds it waits for a chunk's CPU update
(``update_wait_s``) are not seconds the GPU loses. [Note: GPU stalls] An acquire that has to wait
(a chunk to gather, or one whose prefetch may still run) records an event on the compute stream
before the gathers (and any host wait for an update) and one after the compute stream has waited
for them: between the two there is no compute, so the time between them on the GPU is the time
it stood idle. Where a chunk's CPU update was still pending it counts as ``update_stall_s``, the
update and the upload after it: what the step model's ``exposed_cpu_adam`` predicts (beside it in
the run's metrics); otherwise as ``gather_stall_s``, transfers not hidden under compute. A pair is
counted once its second event has run, read without a sync (``Event.query``) at a later acquire
or ``settle``; off CUDA the loop's own thread does the work, and its time is the stall.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .stats import StatsCounter

__all__ = ["StallClock"]


class StallClock:
    def __init__(self, stats: StatsCounter, cuda: bool) -> None:
        self.stats, self.cuda = stats, cuda
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event, str]] = deque()
        """Recorded pairs not yet counted, oldest first (their events complete in this order)."""

    def start(self) -> torch.cuda.Event | float:
        """A mark on the compute stream (off CUDA: the host's clock) before a gather that may wait."""
        if not self.cuda:
            return time.perf_counter()
        self.settle()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start: torch.cuda.Event | float, counter: str) -> None:
        """The mark after the compute stream waited for those gathers; its seconds go to ``counter``
        (an ``EngineStats`` field) once it has run."""
        if isinstance(start, float):
            self.stats.add(**{counter: time.perf_counter() - start})
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((start, end, counter))

    def settle(self) -> None:
        """Counts every pair whose second event has run, oldest first, without waiting for the others."""
        while self._open and self._open[0][1].query():
            start, end, counter = self._open.popleft()
            self.stats.add(**{counter: start.elapsed_time(end) / 1e3})
