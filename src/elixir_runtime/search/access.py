"""The chunk accesses of one step for a candidate layout: the profiled unit events, in chunks.

Each event is a fetch unit acquiring its chunks (forward call, recomputation, or pre-backward).
Private chunks never enter the rCache: they are left out of ``groups`` but kept in ``touched``,
which the step model uses to know when each chunk is first needed.

``UnitEvent.before`` only runs back to the previous event *of the same traced segment*, so a
unit's compute after its own acquisition is in no event's ``before``; ``work`` weighs each unit for
sharing that remainder (``step_time.StepModel``): the parameter elements it multiplies with,
embedding tables excluded (a lookup reads one row per token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..profiler.timeline import Cost, UnitEvent

__all__ = ["AccessTrace", "access_trace", "unit_work"]

FWD, BWD = 0, 1


@dataclass
class AccessTrace:
    groups: list[tuple[int, ...]]
    """Public chunks acquired together by each event (may be empty)."""
    touched: list[tuple[int, ...]]
    """Every chunk of each event's unit, private ones included."""
    phases: list[int]
    costs: list[Cost]
    """Compute between the previous event of the same traced segment and this one."""
    work: list[float] = field(default_factory=list)
    """Parameter elements each event's unit computes with (``unit_work``); empty:
    all events weigh the same."""


def access_trace(
    events: Sequence[UnitEvent],
    unit_chunks: dict[str, tuple[int, ...]],
    private: set[int],
    work: dict[str, float] | None = None,
) -> AccessTrace:
    """``unit_chunks`` maps each unit name to the chunks its parameters live in, ``work`` (optional)
    to the parameter elements it computes with (``unit_work``)."""
    groups, touched, phases, costs, weights = [], [], [], [], []
    for e in events:
        chunks = unit_chunks.get(e.unit, ())
        touched.append(chunks)
        groups.append(tuple(c for c in chunks if c not in private))
        phases.append(FWD if e.phase == "fwd" else BWD)
        costs.append(e.before)
        weights.append(float(work.get(e.unit, 0.0)) if work is not None else 1.0)
    return AccessTrace(groups, touched, phases, costs, weights)


def unit_work(module: nn.Module, params: Sequence[nn.Parameter]) -> int:
    """Elements of ``params`` (a unit's) held by submodules of ``module`` that are not embedding
    tables: what the unit's forward multiplies with, up to a constant per token."""
    mine = {id(p) for p in params}
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            seen.update(id(p) for p in m.parameters(recurse=False))
            continue
        for p in m.parameters(recurse=False):
            if id(p) in mine and id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
