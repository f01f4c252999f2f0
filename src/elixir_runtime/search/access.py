"""The chunk accesses of one step for a candidate layout: the profiled unit events, in chunks.

Each profiled event is a fetch unit acquiring its chunks (forward call, recomputation, or
pre-backward). Private chunks (tied parameters) keep a block of their own and never enter the
rCache, so they are left out of the cache trace but kept in ``touched``, which the cost model
uses to know when each chunk is first needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..profiler.timeline import Cost, UnitEvent

__all__ = ["AccessTrace", "access_trace"]

FWD, BWD = 0, 1


@dataclass
class AccessTrace:
    groups: list[tuple[int, ...]]
    """Public chunks acquired together by each event (may be empty)."""
    touched: list[tuple[int, ...]]
    """Every chunk of each event's unit, private ones included."""
    phases: list[int]
    costs: list[Cost]
    """Compute between the previous event and this one."""


def access_trace(
    events: Sequence[UnitEvent], unit_chunks: dict[str, tuple[int, ...]], private: set[int]
) -> AccessTrace:
    """``unit_chunks`` maps each unit name to the chunks its parameters live in."""
    groups, touched, phases, costs = [], [], [], []
    for e in events:
        chunks = unit_chunks.get(e.unit, ())
        touched.append(chunks)
        groups.append(tuple(c for c in chunks if c not in private))
        phases.append(FWD if e.phase == "fwd" else BWD)
        costs.append(e.before)
    return AccessTrace(groups, touched, phases, costs)
