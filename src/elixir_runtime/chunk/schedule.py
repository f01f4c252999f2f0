"""Belady replacement over the chunk access sequence of the previous iteration of the same kind.

The first iteration of a kind (training step, eval forward) records which chunks are demanded in
what order; later iterations follow that trace and evict the gathered chunk whose next use is
farthest away (never again = infinity). If an iteration deviates from its trace (dynamic control
flow), it falls back to least-recently-used for the rest of the iteration and re-records.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterator

__all__ = ["AccessSchedule"]


class AccessSchedule:
    def __init__(self) -> None:
        self._traces: dict[Hashable, tuple[list[int], dict[int, list[int]]]] = {}
        self._kind: Hashable = None
        self._recording: list[int] = []
        self._following = False
        self._clock = 0
        self._last_access: dict[int, int] = {}

    def begin(self, kind: Hashable) -> None:
        """Starts an iteration, storing the one just finished as the trace of its kind."""
        self.end()
        self._kind = kind
        self._recording = []
        self._following = kind in self._traces

    def end(self) -> None:
        if self._kind is not None and self._recording and not self._follows_completely():
            positions: dict[int, list[int]] = {}
            for i, c in enumerate(self._recording):
                positions.setdefault(c, []).append(i)
            self._traces[self._kind] = (self._recording, positions)
        self._kind = None
        self._recording = []

    def _follows_completely(self) -> bool:
        trace = self._traces.get(self._kind)
        return trace is not None and self._following and len(self._recording) == len(trace[0])

    def access(self, chunk: int) -> None:
        """Records a demand access (not a prefetch)."""
        if self._following:
            trace = self._traces[self._kind][0]
            pos = len(self._recording)
            if pos >= len(trace) or trace[pos] != chunk:
                self._following = False
        self._recording.append(chunk)
        self._clock += 1
        self._last_access[chunk] = self._clock

    def eviction_score(self, chunk: int) -> float:
        """Larger = better to evict: next-use distance under Belady, staleness under LRU."""
        if self._following:
            positions = self._traces[self._kind][1].get(chunk)
            now = len(self._recording)
            if not positions:
                return math.inf
            i = bisect.bisect_left(positions, now)
            return math.inf if i == len(positions) else float(positions[i] - now)
        return float(self._clock - self._last_access.get(chunk, 0)) - 1e12  # below any Belady distance

    def upcoming(self) -> Iterator[tuple[int, int]]:
        """Distinct chunks of the rest of the trace as ``(chunk, distance)``, nearest first."""
        if not self._following:
            return
        trace = self._traces[self._kind][0]
        now = len(self._recording)
        seen: set[int] = set()
        for pos in range(now, len(trace)):
            if trace[pos] not in seen:
                seen.add(trace[pos])
                yield trace[pos], pos - now
