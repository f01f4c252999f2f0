"""The note in every checkpoint that holds Elixir's optimizer state, for whoever opens it without Elixir.

The stock ``Trainer`` resuming an Elixir checkpoint finds no ``optimizer.pt`` and restarts AdamW and
the LR schedule without a word. So the folder says where the state is and names the command that
writes a stock checkpoint from it (``elixir-convert``, ``convert.py``). The main process writes it
with the optimizer index (``optimizer_files.save_optimizer``), atomically and before the marker;
the marker does not sum it (``checkpoint.NOTE_NAME``): a reader may edit or delete it without making
the checkpoint untrustworthy, and ``elixir-convert`` does not copy it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .format import NOTE_NAME, OPTIM_INDEX, atomic_write_text

__all__ = ["write_note"]

_NOTE = """\
# Optimizer state in Elixir's format

elixir-hf wrote this checkpoint. Its optimizer state (AdamW's fp32 master weights, `exp_avg`,
`exp_avg_sq` and steps, by parameter name) is in `optimizer-*-of-*.safetensors` and
`{index}`. There is no `optimizer.pt`.

* `ElixirTrainer` and `elixir-run` resume it with any number of ranks and plan, `--elixir off`
  included (the stock optimizer then gets this state); `ElixirAccelerator.load_state` loads it.
* The stock `transformers.Trainer` without elixir-hf finds no `optimizer.pt` here and restarts
  AdamW and the learning-rate schedule without a word. Convert first, then resume from the new folder:

      elixir-convert {name} {name}-plain

  (or `python -m elixir_hf.commands.convert {name} {name}-plain`; add `--config MODEL` where this folder has
  no `config.json`). The new folder holds the fp32 model, `optimizer.pt` (a `torch.optim.AdamW`
  state_dict in `model.parameters()` order) and this checkpoint's scheduler, Trainer state and RNG
  files.
"""


def write_note(folder: str | os.PathLike[str]) -> None:
    """``folder``'s note (an ``OSError`` names the file, as every checkpoint write does)."""
    folder = Path(folder)
    atomic_write_text(_NOTE.format(index=OPTIM_INDEX, name=folder.name), folder / NOTE_NAME)
