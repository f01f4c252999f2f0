"""The console line of an Elixir run: the stock one, with the engine's numbers in one short entry.

The Trainer prints every log dict (``ProgressCallback`` above the tqdm bar, ``PrinterCallback``
with ``--disable_tqdm``). The ~17 ``elixir/*`` values (``metrics.py``) would make a training line
about five times longer, so ``ElixirTrainer`` swaps these two for the classes below: they print
the line with the ``elixir/*`` values replaced by one ``elixir`` entry (step time, GPU peak and
host memory, skipped steps and loss scale when they matter). Only the console is shortened:
``trainer_state.json``'s ``log_history`` and every reporter (TensorBoard, W&B, ...) keep them all.
"""

from __future__ import annotations

from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

__all__ = ["ElixirPrinterCallback", "ElixirProgressCallback", "SHORT_CONSOLE", "console_logs"]

PREFIX = "elixir/"


class _ShortLine(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs: Any):
        return super().on_log(args, state, control, logs=console_logs(logs), **kwargs)


class ElixirProgressCallback(_ShortLine, ProgressCallback):
    """``ProgressCallback`` printing ``console_logs``."""


class ElixirPrinterCallback(_ShortLine, PrinterCallback):
    """``PrinterCallback`` printing ``console_logs``."""


SHORT_CONSOLE = {ProgressCallback: ElixirProgressCallback, PrinterCallback: ElixirPrinterCallback}


def console_logs(logs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``logs`` without its ``elixir/*`` values and with their summary as ``elixir``."""
    if not logs or not any(k.startswith(PREFIX) for k in logs):
        return logs
    short = {k: v for k, v in logs.items() if not k.startswith(PREFIX)}
    short["elixir"] = summary(logs)
    return short


def summary(logs: dict[str, Any]) -> str:
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
