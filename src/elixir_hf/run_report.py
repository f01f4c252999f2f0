"""A run against its plan, per rank, from its records (``run_record.py``): the table and the plot.

One row per ``metrics.COMPARED`` pair the run logged: step time and the phases the plan predicts
(the GPU's update, the CPU's update of offloaded chunks, the forward's wait for it), the GPU peak,
the host's resident memory beside the pinned shards; the plan's value, then each rank's with its
ratio to it. Times are the median of the logs after the first (it holds the warm-up), memory the
highest logged. The table needs nothing; the PNG needs matplotlib (``elixir-hf[plot]``). The end of
an Elixir Trainer run writes both into ``OUTPUT_DIR/elixir_run`` (``callback.RunRecorder``);
``elixir-plan --run OUTPUT_DIR`` shows them (``commands/plan/run.py``).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .metrics import COMPARED, Compared
from .run_record import REPORT, RankRecord, record_dir, replace_file

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "NOT_DRAWN",
    "PLOT_EXTRA",
    "RunRow",
    "RunTable",
    "drawable",
    "plot_run",
    "run_table",
    "series",
    "write_report",
]

PLOT_EXTRA = "pip install 'elixir-hf[plot]'"
NOT_DRAWN = (
    "no plot: the plan predicts nothing the run measured (a static plan, as on the CPU: no step time, no GPU peak, "
    "nothing pinned); a run on a plan --elixir auto searched on a GPU gets one"
)


@dataclass
class RunRow:
    compared: Compared
    plan: float | None
    ranks: list[float | None]


@dataclass
class RunTable:
    title: str
    records: list[RankRecord]
    rows: list[RunRow]

    def text(self) -> str:
        header = ["", "plan", *(f"rank {r.rank}" for r in self.records)]
        lines = [header]
        for row in self.rows:
            cells = [_number(v) + _ratio(v, row.plan) for v in row.ranks]
            lines.append([f"{row.compared.label}, {row.compared.unit}", _number(row.plan), *cells])
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        body = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines
        ]
        notes = ["times: the median of the logs after the first (it holds the warm-up); memory: the highest logged"]
        if any(row.plan is None for row in self.rows):
            notes.append(
                "plan -: not predicted (times and the GPU peak come with a plan --elixir auto searched on a GPU)"
            )
        if any(row.compared.run == "elixir/host_rss_gib" for row in self.rows):
            notes.append(
                "host RSS: all of the process's resident memory, the pinned shards of offloaded chunks among it"
            )
        return "\n".join([self.title, *(line.rstrip() for line in body), *notes])

    def to_dict(self) -> dict[str, object]:
        return {
            "title": self.title,
            "ranks": [{"rank": r.rank, "host": r.host, "device": r.device, "logs": len(r.logs)} for r in self.records],
            "rows": [
                {"label": row.compared.label, "unit": row.compared.unit, "plan": row.plan, "ranks": row.ranks}
                for row in self.rows
            ],
        }


def run_table(records: list[RankRecord], where: str | os.PathLike[str]) -> RunTable:
    """The rows ``records`` hold a value of: predicted, or measured (not 0) on some rank."""
    rows = []
    for c in COMPARED:
        plan = next((v for r in records if (v := _summary(r.logs, c, c.plan)) is not None), None)
        ranks = [_summary(r.logs, c, c.run) for r in records]
        if plan is not None or any(ranks):  # nothing predicted and nothing measured (0 s updating no chunk): no row
            rows.append(RunRow(c, plan, ranks))
    steps = [log["step"] for r in records for log in r.logs]
    span = f"logs at steps {min(steps)}-{max(steps)}" if steps else "no logs"
    n = len(records)
    title = f"elixir: the run in {where} against its plan ({n} rank{'s' if n != 1 else ''}, {span})"
    return RunTable(title, records, rows)


def series(record: RankRecord, key: str) -> list[tuple[float, float]]:
    """``(step, value)`` of each of the rank's logs that has ``key``."""
    return [(log["step"], log[key]) for log in record.logs if key in log]


def _summary(logs: list[dict[str, float]], c: Compared, key: str) -> float | None:
    values = [log[key] for log in logs if key in log]
    if not values:
        return None
    if key == c.plan:
        return values[-1]
    return max(values) if c.peak else statistics.median(values[1:] or values)


def _number(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _ratio(v: float | None, plan: float | None) -> str:
    if v is None or not plan:
        return ""
    return f" ({v / plan:.2f}x)" if v / plan < 100 else f" ({v / plan:,.0f}x)"


def drawable(table: RunTable) -> bool:
    """Whether a plot would compare anything: a row with a prediction (not 0) and a rank's measurement.
    Else (a CPU run: nothing predicted but the 0 GiB pinned) its panels would be empty, and none is drawn."""
    return any(row.plan and any(v is not None for v in row.ranks) for row in table.rows)


def plot_run(table: RunTable, path: str | os.PathLike[str]) -> None:
    """Three panels: each rank's step time by log beside the plan's, the times by phase and the memory,
    the plan's bar then each rank's. A ``Figure`` of its own: the process's pyplot backend is left alone
    (the end of a run in a notebook)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 9), layout="constrained")
    steps_ax, times_ax, memory_ax = fig.subplots(3, 1, height_ratios=[1.2, 1, 1])
    fig.suptitle(table.title, fontsize=9)
    step = next(c for c in COMPARED if c.run == "elixir/step_s")
    for r in table.records:
        if logged := series(r, step.run):
            steps_ax.plot(*zip(*logged), marker=".", label=f"rank {r.rank}")
    plan = next((row.plan for row in table.rows if row.compared is step), None)
    if plan is not None:
        steps_ax.axhline(plan, color="black", linestyle="--", label=f"plan: {plan:.3g} s")
    steps_ax.set(xlabel="optimizer step", ylabel="step time, s (per log)")
    steps_ax.legend(fontsize=7)
    _bars(times_ax, [row for row in table.rows if row.compared.unit == "s"], table.records, "seconds per step")
    _bars(memory_ax, [row for row in table.rows if row.compared.unit == "GiB"], table.records, "GiB per rank")
    fig.savefig(path, dpi=110)


def _bars(ax: Axes, rows: list[RunRow], records: list[RankRecord], ylabel: str) -> None:
    """Per row, the plan's bar (hatched) and each rank's."""
    width = 0.8 / (len(records) + 1)
    for i, row in enumerate(rows):
        values = [row.plan, *row.ranks]
        for j, v in enumerate(values):
            if v is not None:
                ax.bar(
                    i + (j - len(records) / 2) * width,
                    v,
                    width,
                    color="white" if j == 0 else f"C{j - 1}",
                    edgecolor="black" if j == 0 else f"C{j - 1}",
                    hatch="//" if j == 0 else None,
                    label=("plan" if j == 0 else f"rank {records[j - 1].rank}") if i == 0 else None,
                )
    ax.set_xticks(range(len(rows)), [row.compared.label for row in rows], fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel(ylabel)
    if rows:
        ax.legend(fontsize=7)


def write_report(output_dir: str | os.PathLike[str], records: list[RankRecord]) -> tuple[RunTable, Path | None]:
    """``run_vs_plan.txt`` and, with matplotlib and where it is ``drawable``, ``run_vs_plan.png`` into
    ``OUTPUT_DIR/elixir_run``; the table and the PNG's path (``None``: no matplotlib, or nothing to draw)."""
    folder = record_dir(output_dir)
    table = run_table(records, output_dir)
    replace_file(folder / f"{REPORT}.txt", lambda tmp: tmp.write_text(table.text() + "\n"))
    png = folder / f"{REPORT}.png"
    if importlib.util.find_spec("matplotlib") is None or not drawable(table):
        png.unlink(missing_ok=True)  # an earlier run's
        return table, None
    replace_file(png, lambda tmp: plot_run(table, tmp))
    return table, png
