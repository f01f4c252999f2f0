"""Restart loops of unmodified scripts: transformers' ``get_last_checkpoint``, for Elixir checkpoints.

Scripts in run_clm's shape look for the checkpoint to resume from themselves,
``get_last_checkpoint(output_dir)`` (``from transformers.trainer_utils import get_last_checkpoint``),
and pass the folder it names to ``trainer.train(resume_from_checkpoint=...)``. transformers' answer
is the highest ``checkpoint-N``, finished or not: after a kill during a save, every restart resumes
from the torn folder and fails. ``elixir-run`` puts ``get_last_checkpoint`` below in its place
(``patches.replace_get_last_checkpoint``), so such a loop resumes from the newest complete
checkpoint instead.

[Note: which folders are Elixir's]
A folder is taken as an Elixir run's when one of its checkpoints holds the marker
(``elixir_checkpoint.json``) or the plan (``elixir_plan.json``, written with the weights, before the
marker). Then the answer is ``newest_complete``'s, the one rule ``resume_from_checkpoint=True``
follows too: the newest checkpoint with its marker, a warning naming each newer torn one, and
``None`` (with the warning) when none is complete, so the script starts afresh as it would in an
empty folder. A folder without either file (a stock run's, or a run with Elixir off) gets
transformers' answer unchanged: those checkpoints carry no completion mark to go by.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from transformers import trainer_utils

from .format import MARKER_NAME, PLAN_NAME, checkpoint_folders, newest_complete

__all__ = ["get_last_checkpoint"]

_STOCK: Callable[[str | os.PathLike[str]], str | None] = trainer_utils.get_last_checkpoint
"""transformers' own, kept before ``patches.replace_get_last_checkpoint`` puts this module's in its place."""


def get_last_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """``transformers.trainer_utils.get_last_checkpoint`` that skips torn Elixir checkpoints (warning)."""
    elixir = any((p / MARKER_NAME).is_file() or (p / PLAN_NAME).is_file() for p in checkpoint_folders(folder))
    return newest_complete(folder, required=False) if elixir else _STOCK(folder)
