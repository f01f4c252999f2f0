"""The callbacks ``ElixirTrainer`` adds: the console line, and the run's record against its plan.

**The console line**: the stock one, with the engine's numbers in one short entry. The Trainer
prints every log dict (``ProgressCallback`` above the tqdm bar, ``PrinterCallback`` with
``--disable_tqdm``). The ~17 ``elixir/*`` values (``metrics.py``) would make a training line
about five times longer, so ``ElixirTrainer`` swaps these two for the classes below: they print
the line with the ``elixir/*`` values replaced by one ``elixir`` entry (step time, GPU peak and
host memory, skipped steps and loss scale when they matter). Only the console is shortened:
``trainer_state.json``'s ``log_history`` and every reporter (TensorBoard, W&B, ...) keep them all.

**The run against its plan** (``RunRecorder``): each rank's ``elixir/*`` values go into
``OUTPUT_DIR/elixir_run`` at every training log (``run_record.py``); at the end of training every
rank's record is gathered, and the saving process writes them all with the table and PNG of
``elixir-plan --run`` (``run_report.py``) and logs the table (INFO). TensorBoard gets the
``metrics.COMPARED`` charts as one group (its custom-scalars layout, once) and the table as text; W&B
the table and a chart per comparison with every rank's line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict

from transformers import (
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.integrations import TensorBoardCallback, WandbCallback
from transformers.integrations.integration_utils import rewrite_logs

from .checkpoint.format import _gather
from .metrics import COMPARED
from .run_record import RankRecord, new_run, write_record
from .run_report import NOT_DRAWN, PLOT_EXTRA, RunTable, drawable, series, write_report

__all__ = ["ElixirPrinterCallback", "ElixirProgressCallback", "RunRecorder", "SHORT_CONSOLE", "console_logs"]

PREFIX = "elixir/"
TENSORBOARD_GROUP = "elixir: run vs plan"

logger = logging.getLogger(__name__)


class _ShortLine(TrainerCallback):
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        super().on_log(args, state, control, logs=console_logs(logs), **kwargs)  # ProgressCallback's: None


class ElixirProgressCallback(_ShortLine, ProgressCallback):
    """``ProgressCallback`` printing ``console_logs``."""


class ElixirPrinterCallback(_ShortLine, PrinterCallback):
    """``PrinterCallback`` printing ``console_logs``."""


SHORT_CONSOLE = {ProgressCallback: ElixirProgressCallback, PrinterCallback: ElixirPrinterCallback}


def console_logs(logs: dict[str, object] | None) -> dict[str, object] | None:
    """``logs`` without its ``elixir/*`` values and with their summary as ``elixir``."""
    if not logs or not any(k.startswith(PREFIX) for k in logs):
        return logs
    short = {k: v for k, v in logs.items() if not k.startswith(PREFIX)}
    short["elixir"] = summary(logs)
    return short


def summary(logs: dict[str, object]) -> str:
    """E.g. ``0.213 s/step, GPU peak 4.1 GiB, host 2.3 GiB`` (+ ``2 skipped, loss scale 1.6e+04`` in fp16)."""
    return ", ".join(fmt.format(logs[k]) for k, fmt in _SUMMARY.items() if k in logs and logs[k] != _QUIET.get(k))


_SUMMARY = {
    "elixir/step_s": "{:.3g} s/step",
    "elixir/gpu_peak_gib": "GPU peak {:.3g} GiB",
    "elixir/host_rss_gib": "host {:.3g} GiB",
    "elixir/skipped_steps": "{} skipped",
    "elixir/loss_scale": "loss scale {:.3g}",
}
_QUIET = {"elixir/skipped_steps": 0, "elixir/loss_scale": 1.0}
"""Values not worth a word on the console."""


class RunRecorder(TrainerCallback):
    """This rank's ``elixir/*`` values into ``OUTPUT_DIR/elixir_run``; the run against its plan at the end.

    First in the Trainer's list: its end comes before the reporters close (TensorBoard's writer)."""

    def __init__(self, callbacks: list[TrainerCallback], collect: Callable[[], dict[str, float]]) -> None:
        self.callbacks = callbacks
        """The Trainer's list (the reporters in it when the run starts)."""
        self.collect = collect
        """This rank's ``elixir/*`` values since the last log (``ElixirAccelerator.elixir_metrics``)."""
        self.record: RankRecord | None = None
        self._logged_step = 0
        self._layout_written = False
        self._unwritable = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        record = self.record = RankRecord(rank=args.process_index, world_size=args.world_size, device=str(args.device))
        self._logged_step = state.global_step
        if args.should_save:
            new_run(_output_dir(args), args.world_size)
        self._write(args, record)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: object,
    ) -> None:
        values = {k: v for k, v in (logs or {}).items() if k.startswith(PREFIX)}
        if (record := self.record) is None or not values:
            return
        self._add(args, record, state.global_step, values)
        if state.is_world_process_zero and not self._layout_written:
            self._tensorboard_layout(values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if (record := self.record) is None:
            return
        if state.global_step > self._logged_step:  # the steps since the last log
            self._add(args, record, state.global_step, self.collect())
        records = [RankRecord.from_dict(r) for r in _gather(asdict(record))]  # a collective: every rank is here
        if not args.should_save or not any(r.logs for r in records):
            return
        try:
            for r in records:  # every rank's, on this node's disk too
                write_record(_output_dir(args), r)
            table, png = write_report(_output_dir(args), records)
        except OSError as exc:  # the training is done: a report that cannot be written must not fail it
            logger.warning("elixir: the run against its plan was not written: %s", exc)
            return
        where = f"plot: {png}" if png else NOT_DRAWN if not drawable(table) else f"plot: {PLOT_EXTRA}"
        logger.info("%s\n%s", table.text(), where)
        if state.is_world_process_zero:
            self._to_reporters(table, state.global_step)

    def _add(self, args: TrainingArguments, record: RankRecord, step: int, values: dict[str, float]) -> None:
        if values:
            record.logs.append({"step": step, **values})
            self._write(args, record)
        self._logged_step = step

    def _write(self, args: TrainingArguments, record: RankRecord) -> None:
        """This rank's record; one that cannot be written is said once and kept in memory (the end gathers it)."""
        if self._unwritable:
            return
        try:
            write_record(_output_dir(args), record)
        except OSError as exc:  # a full disk must not end the training: its checkpoints say so where it matters
            self._unwritable = True
            logger.warning("elixir: rank %d's run record is not written from here on: %s", record.rank, exc)

    def _tensorboard_layout(self, values: dict[str, float]) -> None:
        """The ``COMPARED`` pairs this run logs, one chart each, in one group (TensorBoard's Custom Scalars
        tab), under the tags the TensorBoard callback gives them (``rewrite_logs``)."""
        writers = [cb.tb_writer for cb in self.callbacks if isinstance(cb, TensorBoardCallback) and cb.tb_writer]
        charts = {
            f"{c.label}, {c.unit}": ["Multiline", list(rewrite_logs({c.run: 0, c.plan: 0}))]
            for c in COMPARED
            if c.run in values or c.plan in values
        }
        for writer in writers:
            writer.add_custom_scalars({TENSORBOARD_GROUP: charts})
        self._layout_written = True

    def _to_reporters(self, table: RunTable, step: int) -> None:
        for cb in self.callbacks:
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer:
                text = "\n".join("    " + line for line in table.text().splitlines())  # Markdown: as typed
                cb.tb_writer.add_text(TENSORBOARD_GROUP, text, step)
            elif isinstance(cb, WandbCallback):
                _to_wandb(table)


def _output_dir(args: TrainingArguments) -> str:
    assert args.output_dir is not None, "TrainingArguments.__post_init__ sets output_dir"
    return args.output_dir


def _to_wandb(table: RunTable) -> None:
    """The table, and a chart per comparison with each rank's logged values and the plan's, under ``elixir/``."""
    import wandb

    if wandb.run is None:
        return
    rows = [[f"{row.compared.label}, {row.compared.unit}", row.plan, *row.ranks] for row in table.rows]
    charts = {
        "elixir/run_vs_plan": wandb.Table(columns=["", "plan", *(f"rank {r.rank}" for r in table.records)], data=rows)
    }
    for row in table.rows:
        c, xs, ys, keys = row.compared, [], [], []
        for r in table.records:
            if logged := series(r, c.run):
                steps, values = zip(*logged)
                xs.append(list(steps))
                ys.append(list(values))
                keys.append(f"rank {r.rank}")
        if row.plan is not None and xs:
            xs.append(xs[0])
            ys.append([row.plan] * len(xs[0]))
            keys.append("plan")
        if ys:
            charts[f"elixir/run_vs_plan/{c.label}"] = wandb.plot.line_series(
                xs=xs, ys=ys, keys=keys, title=f"{c.label}, {c.unit}", xname="step"
            )
    wandb.run.log(charts)
