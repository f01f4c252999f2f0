"""Per-phase step timing that never adds a host sync to the training step.

On CUDA each phase is bracketed by events; they are read (one sync) only when the totals are
collected, i.e. at a logging step. On the CPU the work is synchronous and wall time is exact.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

__all__ = ["StepTimer"]


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[phase].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[phase] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last call (and resets)."""
        if self._events:
            torch.cuda.synchronize()
            for phase, pairs in self._events.items():
                self._seconds[phase] += sum(s.elapsed_time(e) for s, e in pairs) / 1000.0
            self._events.clear()
        out, self._seconds = dict(self._seconds), defaultdict(float)
        return out
