"""Elixir's log lines and progress bars, governed as transformers governs its own.

**Logging.** The engine logs under the ``elixir_runtime`` logger tree (it imports only torch),
this package under ``elixir_hf``. ``connect_logging`` (called where elixir_hf is entered: ``follow_trainer``,
``follow_accelerator``, ``engine.build_engine``, ``loading.model``'s loads, ``elixir-run``) makes both
trees children of transformers' library root logger, so they take, as transformers' own records do:

* its level, ``transformers.utils.logging.set_verbosity``: the Trainer sets it on each process
  from ``TrainingArguments.get_process_log_level()`` (``--log_level`` on the main process,
  ``--log_level_replica`` on the others), else ``TRANSFORMERS_VERBOSITY``, else WARNING. A level set
  on ``logging.getLogger("elixir_runtime")`` (or any logger below it) wins, as anywhere in ``logging``;
* its handler (stderr) and its ``propagate`` (``transformers.utils.logging.enable_propagation``:
  on to the root logger's handlers, e.g. pytest's or ``logging.basicConfig``'s).

In a plain Accelerate script no Trainer sets a level per process: ``follow_accelerator`` puts the
processes other than the main one at WARNING (the Trainer's default ``--log_level_replica``),
unless the script set a level on the trees itself.

**Progress.** The engine's bars (``elixir_runtime.progress``) and the checkpoint's are
``transformers.utils.logging.tqdm`` (off after ``disable_progress_bar()``, and with
``TQDM_DISABLE=1``, as every tqdm bar) on the process that shows the Trainer's bars:
``follow_trainer`` (rank 0, unless ``--disable_tqdm``), ``follow_accelerator`` (the main process).
Elsewhere none. Where stderr is not a terminal (a log file, a job scheduler's output), a bar's
redraws would each stay in the log as a line: there a phase prints a line as it starts and one as
it ends, with its time (``PhaseLines``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import tqdm
from transformers.utils import logging as hf_logging

from elixir_runtime.progress import BarFactory, set_progress_factory

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = [
    "LOGGER_TREES",
    "PhaseLines",
    "connect_logging",
    "follow_accelerator",
    "follow_trainer",
    "show_progress",
    "tqdm_bar",
]

LOGGER_TREES = ("elixir_runtime", "elixir_hf")

_replica_levels_set: list[logging.Logger] = []
"""The trees ``follow_accelerator`` put at WARNING (``follow_trainer`` hands them back to the Trainer)."""


def connect_logging() -> None:
    """Hangs ``LOGGER_TREES`` under transformers' root logger (configured first: its handler, its
    level from ``TRANSFORMERS_VERBOSITY``). Idempotent."""
    root = cast(logging.Logger, hf_logging.get_logger("transformers"))  # transformers' logger class is one
    for name in LOGGER_TREES:
        tree = logging.getLogger(name)
        if tree.parent is not root:
            # logging has no call for it; ``parent`` is what getEffectiveLevel and callHandlers walk
            tree.parent = root
            tree.setLevel(tree.level)  # same level; clears the loggers' cached levels


def tqdm_bar(total: int | None, desc: str, unit: str = "it") -> Any:
    """One bar of ``elixir_runtime.progress``: transformers' tqdm (a no-op while its bars are disabled),
    gone from the console once closed; where stderr is not a terminal, ``PhaseLines``."""
    if sys.stderr.isatty():
        return hf_logging.tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False)
    if hf_logging.is_progress_bar_enabled() and not os.environ.get("TQDM_DISABLE"):  # any value, as tqdm reads it
        return PhaseLines(total, desc, unit)
    return hf_logging.tqdm(total=total, disable=True)


class PhaseLines:
    """A bar for a log: ``desc ...`` (with its total) as the phase starts, ``desc: done in 1.2 s`` as it ends."""

    def __init__(self, total: int | None, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self._start: float | None = time.perf_counter()
        self._print(f"{desc} ({self._amount(total)}) ..." if total and unit != "it" else f"{desc} ...")

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        if self._start is None:
            return
        seconds, self._start = time.perf_counter() - self._start, None
        if self.total and self.n < self.total:  # left early: an error on its way
            self._print(f"{self.desc}: stopped after {seconds:.1f} s, at {self.n} of {self._amount(self.total)}")
        else:
            self._print(f"{self.desc}: done in {seconds:.1f} s")

    def _amount(self, n: int) -> str:
        if self.unit == "B":
            sized: str = tqdm.tqdm.format_sizeof(n, "B")  # as tqdm's bar writes bytes
            return sized
        return f"{n:,} {self.unit}{'s' if n != 1 and self.unit != 'it' else ''}"

    @staticmethod
    def _print(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def show_progress(on: bool) -> BarFactory | None:
    """Bars on this process (``on``) or none; returns the factory replaced."""
    return set_progress_factory(tqdm_bar if on else None)


def follow_trainer(args: TrainingArguments) -> None:
    """A Trainer with these ``TrainingArguments`` was built on this process: its level governs the
    trees (the Trainer set it, per process), bars where the Trainer shows its own."""
    connect_logging()
    while _replica_levels_set:
        _replica_levels_set.pop().setLevel(logging.NOTSET)
    show_progress(args.process_index == 0 and not args.disable_tqdm)


def follow_accelerator(is_main_process: bool) -> None:
    """An ``ElixirAccelerator`` was built on this process (for a Trainer, ``follow_trainer`` follows)."""
    connect_logging()
    if not is_main_process:
        for name in LOGGER_TREES:
            tree = logging.getLogger(name)
            if tree.level == logging.NOTSET:
                tree.setLevel(logging.WARNING)
                _replica_levels_set.append(tree)
    show_progress(is_main_process)
