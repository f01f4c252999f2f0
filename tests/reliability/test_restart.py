"""Restart loops of unmodified scripts: under ``elixir-run``, transformers' ``get_last_checkpoint``
(which run_clm-style scripts call themselves, then pass the folder to ``train``) names the newest
complete checkpoint, so a run killed during a save resumes on restart instead of failing on the
torn folder each time (``elixir_hf/checkpoint/restart.py``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hf_cases import OFFLOAD_PLAN, save_tiny_lm
from launch import run_python
from transformers.trainer_utils import get_last_checkpoint as stock_get_last_checkpoint

from elixir_hf.checkpoint.format import MARKER_NAME, PLAN_NAME
from elixir_hf.checkpoint.optimizer_files import optim_file_name
from elixir_hf.checkpoint.restart import get_last_checkpoint
from helpers.logs import captured

SCRIPT = Path(__file__).parents[1] / "elixir_hf" / "commands" / "scripts" / "hf_trainer.py"
ARGS = [
    *("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1"),
    *("--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--eval_strategy", "no"),
    *("--report_to", "none", "--use_cpu", "--seed", "0", "--disable_tqdm", "true"),
]


def _losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def test_a_torn_newest_checkpoint_is_skipped_by_an_unmodified_restart(tmp_path) -> None:
    """The script's second launch is the restart: checkpoint-4 torn (no marker, its shard cut in
    half, as a kill during the save leaves it), it resumes from checkpoint-2, warns, and logs the
    uninterrupted run's losses exactly (same ranks and plan: a bitwise resume)."""
    out = tmp_path / "out"
    launch = ["-m", "elixir_hf.commands.run", str(SCRIPT), "--model_name_or_path", str(save_tiny_lm(tmp_path / "m"))]
    launch += [*ARGS, "--output_dir", str(out), "--elixir", OFFLOAD_PLAN]
    first = run_python(*launch)
    assert first.returncode == 0, first.stderr[-3000:]
    whole = _losses(out)
    torn = out / "checkpoint-4"
    (torn / MARKER_NAME).unlink()
    shard = torn / optim_file_name(0, 1)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert stock_get_last_checkpoint(str(out)) == str(torn)  # what the script resumed from before: it failed

    restart = run_python(*launch)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert f"skipping torn checkpoint(s) {torn}" in restart.stderr and f"resuming from {out / 'checkpoint-2'}" in (
        restart.stderr
    )
    assert len(whole) == 4 and _losses(out) == whole
    assert (torn / MARKER_NAME).is_file()  # written again, whole


SEALED = json.dumps({"format": "elixir-checkpoint/1", "step": 1, "optimizer": False, "world_size": None, "files": {}})


def _folders(root: Path, **files: tuple[str, ...]) -> Path:
    for name, names in files.items():
        (root / name).mkdir(parents=True)
        for f in names:
            (root / name / f).write_text(SEALED if f == MARKER_NAME else "{}")
    return root


def test_which_folder_get_last_checkpoint_names(tmp_path, caplog) -> None:
    """Elixir's folders (a marker or a plan in some checkpoint): the newest complete one, else
    ``None``, warning about the torn ones. Other folders: transformers' answer."""
    sealed, torn = (PLAN_NAME, MARKER_NAME), (PLAN_NAME,)
    mixed = _folders(tmp_path / "mixed", **{"checkpoint-9": sealed, "checkpoint-10": torn, "checkpoint-11": ()})
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.format"):
        assert get_last_checkpoint(mixed) == str(mixed / "checkpoint-9")
    assert "skipping torn checkpoint(s)" in caplog.text and str(mixed / "checkpoint-10") in caplog.text

    all_torn = _folders(tmp_path / "torn", **{"checkpoint-3": torn, "checkpoint-5": ()})
    caplog.clear()
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.format"):
        assert get_last_checkpoint(all_torn) is None
    assert "no complete checkpoint is left to resume from" in caplog.text

    stock = _folders(tmp_path / "stock", **{"checkpoint-2": ("trainer_state.json",), "checkpoint-12": ()})
    assert (
        get_last_checkpoint(str(stock)) == stock_get_last_checkpoint(str(stock)) == os.path.join(stock, "checkpoint-12")
    )
