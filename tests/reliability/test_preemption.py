"""Preemption: SIGTERM or SIGUSR1 during ``train()`` finishes the step, writes a complete, verified
checkpoint if it fits the grace period, and exits with status 75; a resume continues bit for bit as
the uninterrupted run. A signal during a save lets it complete and stops there; a save that does not
fit leaves the newest complete checkpoint. The signals are sent from callbacks or the save itself, at
a known point. Before: SIGTERM killed the run where it stood, the newest checkpoint up to
``save_steps`` behind (and ``torchrun`` forwarding it to every rank did the same)."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args
from launch import run_ranks, run_script
from preempt_worker import SignalAt
from safetensors.torch import load_file

import elixir_hf.trainer
from elixir_hf.checkpoint.folder_lock import LOCK_NAME
from elixir_hf.checkpoint.format import MARKER_NAME, verify
from elixir_hf.preemption import EXIT_PREEMPTED
from helpers.logs import captured

SAVE = dict(max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="no")


def _trainer(out: Path, spec: str = OFFLOAD_PLAN):
    return make_trainer("gpt2", training_args(str(out), spec, **SAVE), n_train=64)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    trainer = _trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return history(trainer, "loss")


def _preempted(trainer) -> None:
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == EXIT_PREEMPTED


def _resumed(out: Path) -> list[float]:
    trainer = _trainer(out)
    trainer.train(resume_from_checkpoint=True)
    return history(trainer, "loss")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_mid_step_saves_that_step_and_the_resume_continues(straight, tmp_path, caplog, signum) -> None:
    before = signal.getsignal(signum)
    trainer = _trainer(tmp_path)
    trainer.add_callback(SignalAt(step=3, signum=signum))
    with captured(caplog, logging.WARNING, "elixir_hf.preemption"):
        _preempted(trainer)
    name = signal.Signals(signum).name
    assert f"elixir: {name} on rank 0 at step 3: saving checkpoint-3 (predicted " in caplog.text
    assert f"preempted by {name} on rank 0, with {tmp_path / 'checkpoint-3'} complete and verified (" in caplog.text
    assert history(trainer, "loss") == straight[:3]  # step 3 completed, step 4 never began
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    verify(tmp_path / "checkpoint-3", 0, True)
    assert signal.getsignal(signum) is before  # the handler is train()'s only
    assert _resumed(tmp_path)[3:] == straight[3:]  # bit for bit
    del trainer
    gc.collect()
    assert not (tmp_path / LOCK_NAME).exists()  # the trainers ended cleanly: the folder's lock released


def test_a_save_that_does_not_fit_leaves_the_newest_complete_checkpoint(straight, tmp_path, caplog) -> None:
    trainer = _trainer(tmp_path, OFFLOAD_PLAN[:-1] + ', "preempt_grace_s": 0}')
    trainer.add_callback(SignalAt(step=3, signum=signal.SIGTERM))
    with captured(caplog, logging.WARNING, "elixir_hf.preemption"):
        _preempted(trainer)
    assert history(trainer, "loss") == straight[:3]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    (said,) = [r.getMessage() for r in caplog.records if "no checkpoint" in r.getMessage()]
    assert re.search(r"SIGTERM on rank 0 at step 3: no checkpoint: saving is predicted to take \d+\.\d s", said)
    assert (
        f"preempted by SIGTERM on rank 0, without a new checkpoint (a resume takes the newest complete one: {tmp_path / 'checkpoint-2'})"
        in caplog.text
    )
    assert _resumed(tmp_path)[2:] == straight[2:]


def test_a_signal_during_a_save_lets_it_complete_and_stops_there(straight, tmp_path, monkeypatch) -> None:
    save = elixir_hf.trainer.save_optimizer

    def signalled_save(folder, *args, **kwargs):
        if Path(folder).name == "checkpoint-4":
            os.kill(os.getpid(), signal.SIGTERM)
        return save(folder, *args, **kwargs)

    monkeypatch.setattr(elixir_hf.trainer, "save_optimizer", signalled_save)
    trainer = _trainer(tmp_path)
    _preempted(trainer)
    assert history(trainer, "loss") == straight[:4]  # no step after the save
    assert (tmp_path / "checkpoint-4" / MARKER_NAME).is_file()
    assert _resumed(tmp_path)[4:] == straight[4:]


def test_a_signal_on_one_rank_stops_every_rank_with_the_same_checkpoint(tmp_path) -> None:
    """Two ranks under ``torchrun``; SIGTERM reaches rank 1 only, at step 3: both ranks save
    ``checkpoint-3`` (the weights and Adam state of the uninterrupted run's), verify it and exit 75."""
    proc = run_script("preempt_worker.py", str(tmp_path), ranks=2, timeout=300)
    assert proc.returncode != 0
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [{"exit": EXIT_PREEMPTED}] * 2
    assert re.search(rf"exitcode\s*: {EXIT_PREEMPTED} ", proc.stderr), proc.stderr[-3000:]
    got, want = tmp_path / "preempted" / "checkpoint-3", tmp_path / "straight" / "checkpoint-3"
    assert sorted(p.name for p in (tmp_path / "preempted").glob("checkpoint-*")) == ["checkpoint-3"]
    for name in ("model.safetensors", "optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"):
        a, b = load_file(str(got / name)), load_file(str(want / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_signal_to_the_process_group_saves_with_dataloader_workers(tmp_path) -> None:
    """SLURM's preemption, ``scancel`` or a kill of the group signal the DataLoader's workers too; they
    live on until the run stops (``preemption.py``, [Note: the children live on]). Before: SIGTERM killed
    them and torch raised ``DataLoader worker ... killed by signal: Terminated`` inside the save: no
    checkpoint, exit status 1. SIGUSR1 here, SIGTERM to the group of two ranks below (a launch each)."""
    proc = run_script("group_signal_worker.py", str(tmp_path), "SIGUSR1", "0", new_group=True)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "killed by signal" not in proc.stderr and "exited unexpectedly" not in proc.stderr
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"exit": EXIT_PREEMPTED, "step": 3}
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3"]
    verify(tmp_path / "run" / "checkpoint-3", 0, True)


def test_a_signal_to_the_process_group_of_two_ranks_saves_with_dataloader_workers(tmp_path) -> None:
    """Both ranks and their 4 workers in one group, SIGTERM to it from rank 1 as step 3 begins."""
    ends = run_ranks("group_signal_worker.py", str(tmp_path), "SIGTERM", "1", new_group=True, timeout=300)
    for rank, end in enumerate(ends):
        assert end.returncode == EXIT_PREEMPTED, (rank, end.stderr[-3000:])
        assert "killed by signal" not in end.stderr and "exited unexpectedly" not in end.stderr, rank
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"exit": EXIT_PREEMPTED, "step": 3}
    verify(tmp_path / "run" / "checkpoint-3", 0, True)
