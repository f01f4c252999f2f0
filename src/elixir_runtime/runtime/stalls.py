"""``StallClock``: how long the compute stream stands idle at the forward's gathers of offloaded chunks.

The loop's thread runs ahead of the GPU, so the seconds it waits for a chunk's CPU update
(``update_wait_s``) are not seconds the GPU loses. [Note: GPU stalls] A demand acquire of a chunk
with an update not yet waited for records an event on the compute stream before the gather (and
its host wait) and one after the compute stream has waited for it: between the two there is no
compute, so the time between them on the GPU is the time it stood idle, for the update and the
upload after it. That is what the step model's ``exposed_cpu_adam`` predicts (``update_stall_s``
beside it in the run's metrics). A pair is counted once its second event has run, read without a
sync (``Event.query``) at a later acquire or ``settle``; off CUDA the loop's own thread runs the
work, and its wait is the stall.
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
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        """Recorded pairs not yet counted, oldest first (their events complete in this order)."""

    def start(self) -> torch.cuda.Event | float:
        """A mark on the compute stream (off CUDA: the host's clock) before a gather that may wait."""
        if not self.cuda:
            return time.perf_counter()
        self.settle()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start: torch.cuda.Event | float) -> None:
        """The mark after the compute stream waited for that gather; counted once it has run."""
        if isinstance(start, float):
            self.stats.add(update_stall_s=time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((start, end))

    def settle(self) -> None:
        """Counts every pair whose second event has run, oldest first, without waiting for the others."""
        while self._open and self._open[0][1].query():
            start, end = self._open.popleft()
            self.stats.add(update_stall_s=start.elapsed_time(end) / 1e3)
