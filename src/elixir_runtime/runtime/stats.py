"""The engine's counters since ``prepare``: typed, added to from the loop's and the update lanes' threads.

``StatsCounter.add`` takes a lock (the CPU lane adds its elements and busy seconds from its own
thread), and ``StatsCounter.now`` reads every counter under it: a reader sees all of one
``add`` or none of it (a rate taken from ``updated_cpu / cpu_update_s`` is never torn).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["EngineStats", "StatsCounter"]


@dataclass(frozen=True)
class EngineStats(Mapping[str, float]):
    """The counters at one moment; a read-only ``Mapping`` of its fields too (``dict(stats)`` for logs)."""

    gathers: int = 0
    """Chunks all-gathered into a buffer (prefetches included)."""
    prefetches: int = 0
    """Gathers issued ahead of their use."""
    evictions: int = 0
    """Chunks released to free an rCache block (the Belady victim)."""
    reduces: int = 0
    """Chunk reduce-scatters."""
    updated_cpu: int = 0
    """Offloaded elements the CPU lane updated."""
    updated_device: int = 0
    """Offloaded elements the device lane updated."""
    cpu_update_s: float = 0.0
    """Seconds the CPU lane spent updating them."""
    update_wait_s: float = 0.0
    """Seconds the loop's thread waited for them."""
    update_stall_s: float = 0.0
    """Seconds the GPU stood idle at the forward's gathers that waited for them (``runtime/stalls.py``)."""
    gather_stall_s: float = 0.0
    """Seconds the GPU stood idle at acquires for other gathers: transfers not hidden (``runtime/stalls.py``)."""

    def __getitem__(self, key: str) -> float:
        if key not in _NAMES:
            raise KeyError(key)
        value: float = getattr(self, key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


_NAMES = tuple(f.name for f in fields(EngineStats))


class StatsCounter:
    """The counters, as they grow."""

    def __init__(self) -> None:
        self._counts: dict[str, Any] = asdict(EngineStats())  # each field's int or float
        self._lock = threading.Lock()

    def add(self, **counts: float) -> None:
        """Adds each of ``counts`` (``gathers=1``, ...) to its counter, all at once for a reader."""
        with self._lock:
            for key, n in counts.items():
                self._counts[key] += n

    @property
    def now(self) -> EngineStats:
        with self._lock:
            return EngineStats(**self._counts)
