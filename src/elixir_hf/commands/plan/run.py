"""``elixir-plan --run OUTPUT_DIR [--plot PNG] [--json]``: a run against its plan, per rank
(``run_report.py``), from the records the run wrote (``run_record.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from ...run_record import REPORT, RunRecordError, read_run, record_dir
from ...run_report import NOT_DRAWN, PLOT_EXTRA, drawable, plot_run, run_table

__all__ = ["run_command"]


def run_command(output_dir: str, png: str | None, as_json: bool) -> int:
    """``elixir-plan --run OUTPUT_DIR [--plot PNG] [--json]``: the table on stdout, the PNG into ``PNG``
    (default ``OUTPUT_DIR/elixir_run/run_vs_plan.png``); without matplotlib, the table and how to get it;
    with nothing to compare (``run_report.drawable``: a CPU run), the table and why there is no plot."""
    plotting = importlib.util.find_spec("matplotlib") is not None
    if png and not plotting:  # asked for: an error, as --plot alone is
        print(f"elixir-plan: --plot {png} needs matplotlib: {PLOT_EXTRA}", file=sys.stderr)
        return 1  # EXIT_INPUT (__init__.py)
    try:
        table = run_table(read_run(output_dir), output_dir)
    except RunRecordError as exc:
        print(f"elixir-plan: --run {exc}", file=sys.stderr)
        return 1  # EXIT_INPUT (__init__.py)
    print(json.dumps(table.to_dict(), indent=2) if as_json else table.text())
    aside = sys.stderr if as_json else sys.stdout  # stdout stays one JSON document
    if not drawable(table):
        print(NOT_DRAWN, file=aside)
        return 0
    if not plotting:
        print(f"the plot needs matplotlib: {PLOT_EXTRA}", file=aside)
        return 0
    path = Path(png) if png else record_dir(output_dir) / f"{REPORT}.png"
    plot_run(table, path)
    print(f"plot written to {os.path.abspath(path)}", file=aside)
    return 0
