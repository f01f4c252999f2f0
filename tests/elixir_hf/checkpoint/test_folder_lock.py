"""One job per output folder (``elixir_hf/checkpoint/folder_lock.py``): a second live job on an ``output_dir``
stops before training, naming the folder and the job holding it; the lock is held from ``train()`` to
the trainer's end (its final ``save_model`` included), re-entrant in one process; a lock a dead job
left is taken over, and what its interrupted saves left removed (stages and temporary files of
writers not running, whatever their name); a symbolic link planted at the lock's name is refused;
``--elixir off`` is the stock Trainer's run."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import subprocess
import sys

import pytest
from hf_cases import OFFLOAD_PLAN, make_trainer, training_args

from elixir_hf.checkpoint.folder_lock import LOCK_NAME, FolderInUse, FolderLockError, hold, sweep
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
    assert (out / "checkpoint-2").is_dir()
    del trainer
    gc.collect()
    assert not (out / LOCK_NAME).exists()  # a clean end leaves nothing


def _held_elsewhere(folder) -> bool:
    """Whether a second open of the lock file (another job's) finds it locked."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_lock_is_held_through_the_final_save_model(tmp_path) -> None:
    """Before: ``train()`` released it, and a second job started during the final ``save_model`` took
    its live stage for an interrupted save's and removed it."""
    out = tmp_path / "out"
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **{**RUN, "save_strategy": "no"}))
    trainer.train()
    assert _held_elsewhere(out)
    second = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **{**RUN, "save_strategy": "no"}))
    second.train()  # the same process: it shares the hold
    del second
    gc.collect()
    assert _held_elsewhere(out)  # the first trainer still holds it
    trainer.save_model()
    assert (out / "model.safetensors").is_file() and _held_elsewhere(out)
    del trainer
    gc.collect()
    assert not (out / LOCK_NAME).exists()


class _Job:
    """An owner of a hold (the trainer, in a run)."""


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_what_interrupted_saves_left_is_swept_unless_its_writer_runs(tmp_path, caplog) -> None:
    dead, live = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # until killed
    try:
        ck = tmp_path / "checkpoint-4"
        ck.mkdir()
        leaked = [
            ck / f".optimizer-00001-of-00002.safetensors.tmp{dead}",  # a rank's Adam shard, killed mid-write
            tmp_path / f".model.safetensors.tmp{dead}",
            tmp_path / f".elixir-save-{dead}-x1y2",  # a save_model stage
            ck / ".elixir-save-abc123",  # a stage named before 0.2: no pid
        ]
        kept = [
            ck / f".optimizer-00000-of-00002.safetensors.tmp{live.pid}",
            tmp_path / f".elixir-save-{live.pid}-q9",
            tmp_path / ".hidden",
            ck / "model.safetensors",
        ]
        for p in leaked + kept:
            p.mkdir() if "elixir-save" in p.name else p.write_bytes(b"x" * 64)
        with captured(caplog, logging.WARNING, "elixir_hf"):
            assert sorted(sweep(tmp_path)) == sorted(leaked)
        assert [p for p in leaked + kept if p.exists()] == kept
        assert f"removing {leaked[0]}, left by an interrupted save" in caplog.text
    finally:
        live.kill()
        live.wait()


def test_a_symbolic_link_at_the_locks_name_is_refused_naming_it(tmp_path) -> None:
    """Before: the lock followed it, truncated its target and printed its first 80 characters."""
    target = tmp_path / "secret.txt"
    target.write_text("do not touch")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(target)
    with pytest.raises(FolderLockError, match=rf"{out / LOCK_NAME} is a symbolic link \(to '{target}'\)"):
        hold(out, _Job())
    assert target.read_text() == "do not touch"
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **RUN))
    with pytest.raises(CheckpointError, match=rf"(?s)taking output_dir {out} failed:.*{LOCK_NAME} is a symbolic link"):
        trainer.train()
    assert target.read_text() == "do not touch"


def test_a_second_owner_in_one_process_shares_the_hold_another_process_is_refused(tmp_path) -> None:
    first, second = _Job(), _Job()
    hold(tmp_path, first)
    hold(tmp_path, second)
    hold(tmp_path, first)  # again: nothing more
    probe = "from elixir_hf.checkpoint.folder_lock import hold\nclass J: pass\nhold({!r}, J())"
    other = subprocess.run([sys.executable, "-c", probe.format(str(tmp_path))], capture_output=True, text=True)
    assert other.returncode == 1 and f"{tmp_path} is in use by another job (pid {os.getpid()}" in other.stderr
    assert FolderInUse.__name__ in other.stderr
    del first
    gc.collect()
    assert _held_elsewhere(tmp_path)
    del second
    gc.collect()
    assert not (tmp_path / LOCK_NAME).exists()
