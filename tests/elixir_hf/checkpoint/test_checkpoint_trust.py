"""What a checkpoint's own files may say, and what is trusted: a corrupt newest marker (empty or ``{}``,
as an interrupted copy leaves it) is named and the resume, and a restart loop, fall back to the newest
complete checkpoint with a warning; file names read from a marker or an optimizer index stay inside the
checkpoint folder; a plain Adam state with a field missing is refused, not loaded with zeros;
``elixir-convert`` refuses its own source and a target with files (unless ``--overwrite``) and copies a
symbolic link as the link; ``--elixir off`` resumes with a parameter now frozen.

Before: a corrupt marker raised a bare ``JSONDecodeError``/``KeyError`` in every resume and restart; a
marker's ``../`` name was read outside the folder; a plain ``optimizer.pt`` entry without ``step`` or a
moment loaded with zeros in its place."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args
from safetensors.torch import load_file

from elixir_hf.checkpoint.folder_lock import LOCK_NAME
from elixir_hf.checkpoint.format import (
    MARKER_NAME,
    OPTIM_INDEX,
    CheckpointError,
    atomic_write_text,
    newest_complete,
    read_marker,
)
from elixir_hf.checkpoint.restart import get_last_checkpoint
from elixir_hf.commands import convert
from elixir_hf.trainer import ElixirTrainer
from helpers.logs import captured

SAVE = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no")


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """A 4-step Elixir run with checkpoints at steps 2 and 4; returns (run dir, losses)."""
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **SAVE), n_train=32)
    trainer.train()
    return out, history(trainer, "loss")


def _copy(saved_run, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run[0], run, ignore=shutil.ignore_patterns(LOCK_NAME))  # the run still holds it
    return run


@pytest.mark.parametrize("marker", ["", "{}", '{"format": "elixir-checkpoint/1"}'], ids=["empty", "braces", "no-files"])
def test_a_corrupt_newest_marker_is_named_and_the_resume_falls_back(saved_run, tmp_path, caplog, marker) -> None:
    run = _copy(saved_run, tmp_path)
    bad = run / "checkpoint-4" / MARKER_NAME
    bad.write_text(marker)
    with pytest.raises(CheckpointError, match=rf"^{bad} is corrupt"):
        read_marker(bad.parent)
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.format"):
        assert newest_complete(run) == get_last_checkpoint(run) == str(run / "checkpoint-2")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(
        m.startswith(f"skipping checkpoint(s) with a corrupt marker: {run / 'checkpoint-4'} ({bad} is corrupt")
        and m.endswith(f"resuming from {run / 'checkpoint-2'}")
        for m in said
    ), said
    named = make_trainer("gpt2", training_args(str(tmp_path / "b"), OFFLOAD_PLAN, **SAVE), n_train=32)
    with pytest.raises(CheckpointError, match=rf"(?s)verifying checkpoint .*{bad} is corrupt"):
        named.train(resume_from_checkpoint=str(bad.parent))
    trainer = make_trainer("gpt2", training_args(str(run), OFFLOAD_PLAN, **SAVE), n_train=32)
    trainer.train(resume_from_checkpoint=True)
    assert history(trainer, "loss", after_step=2) == saved_run[1][2:]


def test_with_every_marker_corrupt_the_resume_names_each(saved_run, tmp_path) -> None:
    run = _copy(saved_run, tmp_path)
    for step in (2, 4):
        (run / f"checkpoint-{step}" / MARKER_NAME).write_text("")
    with pytest.raises(
        CheckpointError, match=rf"\({run}\): no complete checkpoint to resume from \(skipped checkpoint"
    ):
        newest_complete(run)
    assert get_last_checkpoint(run) is None  # a restart loop starts afresh


def _rewrite(ckpt: Path, name: str, edit) -> None:
    """``ckpt/name`` (JSON) edited, its sum in the marker updated."""
    path = ckpt / name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    marker["files"][name] = {"bytes": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))


def test_names_in_a_marker_or_an_index_stay_inside_the_checkpoint(saved_run, tmp_path) -> None:
    run = _copy(saved_run, tmp_path)
    outside = tmp_path / "private.bin"
    outside.write_bytes(b"secret")
    ckpt = run / "checkpoint-4"
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    marker["files"]["../../private.bin"] = {"bytes": 6, "crc32": zlib.crc32(b"secret")}
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"names the file '\.\./\.\./private\.bin', which is not inside"):
        read_marker(ckpt)

    ckpt = run / "checkpoint-2"

    def escape(index):
        name = next(iter(index["params"]))
        index["params"][name]["pieces"][0][0] = "../checkpoint-4/optimizer-00000-of-00001.safetensors"
        return index

    _rewrite(ckpt, OPTIM_INDEX, escape)
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **SAVE), n_train=32)
    with pytest.raises(CheckpointError, match=r"names the file '\.\./checkpoint-4/optimizer-00000"):
        trainer.train(resume_from_checkpoint=str(ckpt))


@pytest.mark.parametrize("field", ["step", "exp_avg_sq"])
def test_a_plain_adam_state_without_a_field_is_refused(tmp_path, field: str) -> None:
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE), n_train=32)
    stock.train()
    ckpt = tmp_path / "stock" / "checkpoint-2"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    del state["state"][3][field]
    torch.save(state, ckpt / "optimizer.pt")
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "elixir"), OFFLOAD_PLAN, **SAVE), n_train=32)
    with pytest.raises(CheckpointError, match=rf"optimizer\.pt: the Adam state of parameter number 3 lacks '{field}'"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert not history(trainer, "loss", after_step=2), "no step may run"


def test_convert_refuses_its_source_and_a_target_with_files(saved_run, tmp_path) -> None:
    """Before: ``elixir-convert CK CK`` wrote into its source, then failed."""
    ckpt = saved_run[0] / "checkpoint-2"
    for out in (ckpt, ckpt / "plain"):
        with pytest.raises(SystemExit, match=rf"elixir-convert: OUT {out} is the checkpoint {ckpt} \(or inside it\)"):
            convert.main([str(ckpt), str(out)])
    assert not (ckpt / "optimizer.pt").exists() and not (ckpt / "plain").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=rf"OUT {used} exists and holds files: give a new folder, or --overwrite"):
        convert.main([str(ckpt), str(used)])
    convert.main([str(ckpt), str(used), "--overwrite"])
    assert (used / "optimizer.pt").is_file() and (used / "notes.txt").read_text() == "mine"


def test_convert_copies_a_symbolic_link_as_the_link(saved_run, tmp_path, caplog) -> None:
    """Before: it copied the target's contents (a private file published with the model)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-2", ckpt)
    private = tmp_path / "private.txt"
    private.write_text("secret")
    (ckpt / "notes.txt").symlink_to(private)
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.convert"):
        convert.main([str(ckpt), str(tmp_path / "plain")])
    copied = tmp_path / "plain" / "notes.txt"
    assert copied.is_symlink() and os.readlink(copied) == str(private)
    assert f"{ckpt / 'notes.txt'} is a symbolic link (to {private}): copied as the link" in caplog.text


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path) -> None:
    target = tmp_path / "victim.txt"
    target.write_text("do not touch")
    (tmp_path / f".x.json.tmp{os.getpid()}").symlink_to(target)
    atomic_write_text('{"a": 1}', tmp_path / "x.json")
    assert target.read_text() == "do not touch" and (tmp_path / "x.json").read_text() == '{"a": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt", "x.json"]


def test_elixir_off_resumes_with_a_parameter_now_frozen(saved_run, tmp_path, caplog) -> None:
    """Before: an internal ``not enough values to unpack``. Now its weights load, its Adam state is left
    out with a warning naming it, and the others continue."""
    data = make_trainer("gpt2", training_args(str(tmp_path / "ref"), **SAVE), n_train=32)
    frozen = data.model.transformer.h[0].mlp.c_fc.weight
    frozen.requires_grad_(False)
    off = ElixirTrainer(
        model=data.model,
        args=training_args(str(tmp_path / "off"), "off", **SAVE),
        train_dataset=data.train_dataset,
        data_collator=data.data_collator,
    )
    with captured(caplog, logging.WARNING, "elixir_hf.checkpoint.convert"):
        off.train(resume_from_checkpoint=str(saved_run[0] / "checkpoint-2"))
    assert (
        "1 parameter(s) with Adam state in" in caplog.text
        and "(frozen: transformer.h.0.mlp.c_fc.weight)" in caplog.text
    )
    saved = load_file(str(saved_run[0] / "checkpoint-2" / "model.safetensors"))["transformer.h.0.mlp.c_fc.weight"]
    assert torch.equal(frozen.detach(), saved) and len(history(off, "loss", after_step=2)) == 2
