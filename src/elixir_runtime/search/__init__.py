"""The search: hardware profile, Belady simulation, chunk size, placement, step time.

``search(table, profile, hardware, budget, settings)`` turns a profiled step (``profiler``) and a
measured machine (``hardware``) into the chunk size, rCache size and offloaded chunks with the
fastest predicted step that fits the memory budget, with the winning layout. Pure: it measures
nothing and decides nothing beyond its inputs (``planner.py`` gathers them and makes the plan).
"""

from .budget import Budget
from .loop import SearchResult, SearchSettings, search
from .report import Alternative, Candidate, RateSummary, SearchReport
from .step_time import StepTime

__all__ = [
    "Alternative",
    "Budget",
    "Candidate",
    "RateSummary",
    "SearchReport",
    "StepTime",
    "SearchResult",
    "SearchSettings",
    "search",
]
