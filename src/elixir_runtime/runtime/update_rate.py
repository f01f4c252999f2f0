"""The rate a job's CPU lane updates offloaded chunks at in its own steps, taken once and reported.

[Note: the run's own rate] The hardware profile times the CPU Adam on a small set of arenas it has
just allocated; the plan needs the rate of the job's own pinned arenas beside its forward's
uploads, which only the job sees (docs/planning.md, "The run's own rate").
The probe takes each step's rate (elements / the CPU lane's busy seconds), leaves out the first
``SKIP`` steps' updates (warm-up), and once step ``SKIP + STEPS``'s are done (in the next
``step()``, which waits for them) reports the median of steps ``SKIP + 1 .. SKIP + STEPS`` whose
updates ran after a host sync (clipping, the non-finite check: the case the step model prices with
it), once. Every rank reports in the same ``step()`` call, so the report may be a collective
(``api.prepare`` wires it to ``hardware.load.record_update_rate``: the slowest rank's rate into
this machine's cached profile, which the next plan made here prices those updates at)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from .stats import StatsCounter

__all__ = ["UpdateRateProbe", "SKIP", "STEPS"]

SKIP = 2
"""Steps whose updates are not counted: the first run on arenas the host has not warmed up yet."""
STEPS = 8
"""Steps whose updates' rates are taken: 3-10."""


class UpdateRateProbe:
    """Feeds on ``stats`` (the runtime's counters ``updated_cpu`` and ``cpu_update_s``) at each
    ``step()``; calls ``report(rate)`` once, in the same call on every rank, with the median rate of
    the counted steps whose updates were synced (0.0 where fewer than half of them were)."""

    def __init__(self, stats: StatsCounter, report: Callable[[float], object]) -> None:
        self.stats, self.report = stats, report
        self.rates: list[float] = []
        """The counted steps' rates (elements/s), synced ones only."""
        self.calls = 0
        self._last = (0.0, 0.0)
        self.done = False

    def step_done(self, synced: bool) -> None:
        """At the start of a ``step()``, the updates the one before submitted done: ``synced`` says
        whether they ran after a host sync. (The first call has none: no step before it.)"""
        if self.done:
            return
        stats = self.stats.now
        now = (float(stats.updated_cpu), stats.cpu_update_s)
        elements, busy = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        step = self.calls  # the step whose updates these were (1-based; 0: none yet)
        self.calls += 1
        if step > SKIP and synced and elements > 0 and busy > 0:
            self.rates.append(elements / busy)
        if step == SKIP + STEPS:
            self.done = True
            self.report(statistics.median(self.rates) if 2 * len(self.rates) >= STEPS else 0.0)
