"""Checkpoints under faults: a training process killed (SIGKILL) at each phase of a save, a full
disk (ENOSPC part-way through a file), and truncated, corrupt, foreign and stale files. Each
resume either continues exactly where the newest complete checkpoint left off or fails before
training, on every rank, naming the bad file."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import signal
import zlib
from pathlib import Path

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args
from launch import assert_clean_exits, run_ranks, run_script
from save_worker import trainer as killed_run

import elixir_hf.checkpoint.format
from elixir_hf.checkpoint.format import MARKER_NAME, CheckpointError
from helpers.logs import captured

SAVE = dict(max_steps=10, save_strategy="steps", save_steps=5, eval_strategy="no")
SHARD = "optimizer-00000-of-00001.safetensors"
INDEX = "optimizer.safetensors.index.json"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[float]]:
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **SAVE), n_train=80)
    trainer.train()
    return out, history(trainer, "loss")


def _resume(tmp_path: Path, ckpt: Path | bool, **overrides):
    args = training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **{**SAVE, **overrides})
    trainer = make_trainer("gpt2", args, n_train=80)
    trainer.train(resume_from_checkpoint=ckpt if isinstance(ckpt, bool) else str(ckpt))
    return trainer


def _copy(saved_run, tmp_path: Path, step: int = 5) -> Path:
    ckpt = tmp_path / f"checkpoint-{step}"
    shutil.copytree(saved_run[0] / f"checkpoint-{step}", ckpt)
    return ckpt


# ------------------------------------------------------------------ kill -9 during a save
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    trainer = killed_run(str(tmp_path_factory.mktemp("whole")))
    trainer.train()
    return history(trainer, "loss")


PHASES = {"weights": 2, "shard": 2, "trainer_state": 2, "marker": 2, "rotation": 4}  # -> resumes from


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """One run per phase, each killed during the save of checkpoint-4; their signals."""
    out = tmp_path_factory.mktemp("killed")
    proc = run_script("save_worker.py", str(out), *PHASES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "status.json").read_text())


@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_save_resumes_from_newest_complete(killed, caplog, uninterrupted, phase: str) -> None:
    out, status = killed
    run, resumes_from = out / phase, PHASES[phase]
    assert status[phase] == signal.SIGKILL
    assert (run / "checkpoint-4").is_dir()  # the torn folder a stock resume would pick
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.format"):
        assert elixir_hf.checkpoint.format.newest_complete(run) == str(run / f"checkpoint-{resumes_from}")
    assert ("torn checkpoint" in caplog.text) == (resumes_from == 2)
    resumed = killed_run(str(run))
    resumed.train(resume_from_checkpoint=True)
    assert history(resumed, "loss", after_step=resumes_from) == uninterrupted[resumes_from:]


def test_explicit_torn_checkpoint_fails_clearly(saved_run, tmp_path) -> None:
    ckpt = _copy(saved_run, tmp_path)
    (ckpt / MARKER_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"{ckpt} is incomplete: it has no {MARKER_NAME}"):
        _resume(tmp_path, ckpt)


def test_no_complete_checkpoint_fails_clearly(tmp_path) -> None:
    (tmp_path / "new" / "checkpoint-5").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint.*torn.*checkpoint-5"):
        _resume(tmp_path, True)


# ------------------------------------------------------------------ a full disk
class _FullDisk(io.FileIO):
    """A file on a disk that fills up after ``room`` bytes: the write fails with ENOSPC."""

    room = 3000

    def write(self, data) -> int:
        if self.tell() + len(memoryview(data).cast("B")) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_disk_full_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(
        elixir_hf.checkpoint.format,
        "open",
        lambda path, mode, **kw: _FullDisk(path, mode.replace("b", ""), **kw),
        raising=False,
    )
    trainer = make_trainer("gpt2", training_args(str(tmp_path), OFFLOAD_PLAN, **SAVE), n_train=80)
    with pytest.raises(
        CheckpointError,
        match=rf"No space left on device \(writing checkpoint file {tmp_path}/"
        rf"checkpoint-5/{INDEX}; the partial file was removed\)",
    ):
        trainer.train()
    ckpt = tmp_path / "checkpoint-5"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], "a temporary file was left behind"
    assert not (ckpt / MARKER_NAME).exists()


def test_disk_full_in_a_torch_save_keeps_the_os_error(tmp_path, monkeypatch) -> None:
    """torch.save's own C++ writer reports ``basic_ios::clear: iostream error``; ours, errno."""
    monkeypatch.setattr(
        elixir_hf.checkpoint.format,
        "open",
        lambda path, mode, **kw: _FullDisk(path, mode.replace("b", ""), **kw),
        raising=False,
    )
    path = tmp_path / "big.pt"
    with pytest.raises(OSError) as info:
        elixir_hf.checkpoint.format.atomic_torch_save({"w": torch.zeros(10_000)}, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ bad files
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt(path: Path) -> None:
    """4,000 random bytes in the middle (measured before: accepted, the next checkpoint 98 % NaN)."""
    data = bytearray(path.read_bytes())
    n = min(4000, len(data) // 2)
    data[len(data) // 4 : len(data) // 4 + n] = os.urandom(n)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [SHARD, INDEX, "model.safetensors", "scheduler.pt", "trainer_state.json"])
@pytest.mark.parametrize("damage, message", [(_truncate, "truncated"), (_corrupt, "corrupt")])
def test_damaged_file_is_named(saved_run, tmp_path, name: str, damage, message: str) -> None:
    ckpt = _copy(saved_run, tmp_path)
    damage(ckpt / name)
    with pytest.raises(CheckpointError, match=f"{ckpt / name} is {message}"):
        _resume(tmp_path, ckpt)


@pytest.mark.parametrize("name", [SHARD, "model.safetensors"])
def test_file_of_another_step_is_named(saved_run, tmp_path, name: str) -> None:
    """Measured before: a later step's shard silently overrode the checkpoint's weights."""
    ckpt = _copy(saved_run, tmp_path)
    shutil.copy(saved_run[0] / "checkpoint-10" / name, ckpt / name)
    with pytest.raises(CheckpointError, match=f"{ckpt / name} is corrupt or from another checkpoint"):
        _resume(tmp_path, ckpt)


def test_stale_shard_with_a_matching_marker_is_named(saved_run, tmp_path) -> None:
    """Past the sums (the marker rewritten too), the shard's own step still differs."""
    ckpt = _copy(saved_run, tmp_path)
    shutil.copy(saved_run[0] / "checkpoint-10" / SHARD, ckpt / SHARD)
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    data = (ckpt / SHARD).read_bytes()
    marker["files"][SHARD] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=f"{ckpt / SHARD} is stale: it holds step 10 and the checkpoint step 5"):
        _resume(tmp_path, ckpt)


# ------------------------------------------------------------------ save_only_model
def test_save_only_model_resumes_weights_only_as_the_stock_trainer(tmp_path) -> None:
    """Weights and the Trainer's state from the checkpoint, a fresh optimizer and scheduler:
    the resumed losses match the stock Trainer's resume, and differ from the uninterrupted run."""
    losses = {}
    for name, plan in (("stock", None), ("elixir", OFFLOAD_PLAN)):
        args = dict(SAVE, save_only_model=True)
        first = make_trainer("gpt2", training_args(str(tmp_path / name), plan, **args), n_train=80)
        first.train()
        resumed = make_trainer("gpt2", training_args(str(tmp_path / name), plan, **args), n_train=80)
        resumed.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-5"))
        losses[name] = (history(first, "loss", after_step=5), history(resumed, "loss", after_step=5))
    (_, stock_resumed), (elixir_full, elixir_resumed) = losses["stock"], losses["elixir"]
    assert len(elixir_resumed) == len(stock_resumed) == 5
    for got, want in zip(elixir_resumed, stock_resumed):
        assert got == pytest.approx(want, rel=1e-5)
    assert elixir_resumed != elixir_full  # a fresh Adam state, not the saved one


# ------------------------------------------------------------------ ElixirAccelerator, 2 ranks
def test_load_state_with_a_missing_shard_fails_on_every_rank(tmp_path) -> None:
    """Measured before: rank 1 went on silently with a fresh Adam state, and the losses diverged."""
    assert_clean_exits(run_ranks("load_state_worker.py", str(tmp_path)))
    for rank in (0, 1):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert outcome.startswith("CheckpointError: verifying checkpoint"), outcome
        assert f"rank 1: CheckpointError: {tmp_path}/state/optimizer-00001-of-00002.safetensors is missing" in outcome


@pytest.mark.parametrize(
    ("fault", "what", "error"),
    [
        (
            "full",
            "saving checkpoint {run}/checkpoint-2",
            "No space left on device: '{run}/checkpoint-2/trainer_state.json'",
        ),
        ("read-only", "taking output_dir {run}", "Read-only file system: '{run}/.elixir-job.lock'"),
    ],
)
def test_an_error_on_rank_0_alone_reaches_every_rank_by_name(tmp_path, fault: str, what: str, error: str) -> None:
    """Rank 0 alone finds the disk full writing ``trainer_state.json``, or its output folder read-only: both
    ranks raise it, named. Before: rank 0 raised alone and rank 1 got gloo's "Connection closed by peer"."""
    run_ranks("rank0_error_worker.py", str(tmp_path), fault, timeout=300)
    run = tmp_path / "run"
    for rank in range(2):
        raised = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert raised["type"] == "CheckpointError", (rank, raised)
        assert raised["message"].startswith(f"{what.format(run=run)} failed:\n  rank 0: "), raised
        assert error.format(run=run) in raised["message"] and "rank 1:" not in raised["message"], raised
