"""One job per output folder (``elixir_hf/checkpoint/folder_lock.py``): a second live job on an ``output_dir``
stops before training, naming the folder and the job holding it; a lock a dead job left is taken
over, and its orphaned save stages removed; ``--elixir off`` is the stock Trainer's run."""

from __future__ import annotations

import fcntl
import json
import logging
import os

import pytest
from hf_cases import OFFLOAD_PLAN, make_trainer, training_args

from elixir_hf.checkpoint.folder_lock import LOCK_NAME
from elixir_hf.checkpoint.format import CheckpointError
from helpers.logs import captured

RUN = dict(max_steps=2, save_strategy="steps", save_steps=2, eval_strategy="no")
OTHER = {"host": "node7", "pid": 4242, "job": "SLURM_JOB_ID=99", "started": "2026-11-27T20:00:00+00:00"}


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def _held_by_another_job(folder) -> int:
    """The lock as a live job holds it: flocked on its own open file, its holder written."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(OTHER).encode())
    return fd


def test_a_second_job_on_a_live_folder_stops_before_training(tmp_path) -> None:
    out = tmp_path / "out"
    fd = _held_by_another_job(out)
    try:
        trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **RUN))
        with pytest.raises(
            CheckpointError, match=rf"{out} is in use by another job \(pid 4242 on node7, SLURM_JOB_ID=99"
        ):
            trainer.train()
        assert not list(out.glob("checkpoint-*")) and trainer.state.global_step == 0
        off = make_trainer("gpt2", training_args(str(out), "off", **RUN))  # the stock Trainer takes no lock
        off.train()
        assert (out / "checkpoint-2").is_dir()
    finally:
        os.close(fd)


def test_a_dead_jobs_lock_is_taken_over_and_its_save_stages_removed(tmp_path, caplog) -> None:
    out = tmp_path / "out"
    (out / "checkpoint-1" / ".elixir-save-abc123").mkdir(parents=True)  # a kill mid-save left these
    (out / "checkpoint-1" / ".elixir-save-abc123" / "model.safetensors").write_bytes(b"0" * 1024)
    (out / ".elixir-save-def456").mkdir()
    (out / LOCK_NAME).write_text(json.dumps(OTHER))  # written, but no process holds it
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **RUN))
    with captured(caplog, logging.WARNING, "elixir_hf"):
        trainer.train()
    assert "was locked by a job that is not running (pid 4242 on node7" in caplog.text
    assert not list(out.glob("**/.elixir-save-*"))
    assert (out / "checkpoint-2").is_dir() and not (out / LOCK_NAME).exists()  # a clean end leaves nothing
