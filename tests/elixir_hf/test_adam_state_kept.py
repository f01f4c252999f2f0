"""Adam state is never dropped in silence: an Elixir checkpoint tells a reader without Elixir that
its optimizer state is not an ``optimizer.pt`` and names the command that writes one; a plain
checkpoint missing a trainable parameter's Adam state is refused, naming the parameter and the fix;
``elixir-convert`` writes every trainable parameter's state, one that never had a gradient included."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args

from elixir_hf.checkpoint.convert import torch_adam_state
from elixir_hf.checkpoint.format import MARKER_NAME, NOTE_NAME, OPTIM_INDEX, CheckpointError, verify
from elixir_hf.commands import convert

SAVE = dict(max_steps=2, save_strategy="steps", save_steps=2, eval_strategy="no")


@pytest.fixture(scope="module")
def elixir_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elixir")
    make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **SAVE), n_train=32).train()
    return out / "checkpoint-2"


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory) -> tuple[Path, list[str]]:
    """A stock Trainer's checkpoint and its optimizer's parameter names, in ``optimizer.pt``'s numbering."""
    out = tmp_path_factory.mktemp("stock")
    stock = make_trainer("gpt2", training_args(str(out), **SAVE), n_train=32)
    stock.train()
    names = {id(p): n for n, p in stock.model.named_parameters()}
    return out / "checkpoint-2", [names[id(p)] for g in stock.optimizer.param_groups for p in g["params"]]


def test_the_note_names_the_command_that_writes_a_stock_checkpoint(elixir_checkpoint, tmp_path, monkeypatch) -> None:
    """The note's command, run as written next to the checkpoint, writes the ``optimizer.pt`` the stock
    Trainer reads; the note is not summed in the marker, so editing or deleting it keeps the checkpoint
    whole; the converted folder does not carry it (it has an ``optimizer.pt``)."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(elixir_checkpoint, ckpt)
    note = (ckpt / NOTE_NAME).read_text()
    assert "There is no `optimizer.pt`" in note and "restarts\n  AdamW and the learning-rate schedule" in note
    (command,) = re.findall(r"^ {6}(elixir-convert .*)$", note, flags=re.M)
    assert command == "elixir-convert checkpoint-2 checkpoint-2-plain"
    (module,) = re.findall(r"python -m ([\w.]+) checkpoint-2 checkpoint-2-plain", note)
    assert importlib.import_module(module).main is convert.main  # the other spelling runs the same command
    assert NOTE_NAME not in json.loads((ckpt / MARKER_NAME).read_text())["files"]
    (ckpt / NOTE_NAME).unlink()
    verify(ckpt, 0, True)  # a reader's edit of the note leaves the checkpoint trusted

    monkeypatch.chdir(tmp_path)
    convert.main(shlex.split(command)[1:])
    plain = tmp_path / "checkpoint-2-plain"
    assert (plain / "optimizer.pt").is_file() and not (plain / NOTE_NAME).exists()


def test_a_plain_checkpoint_without_a_parameters_adam_state_is_refused(stock_checkpoint, tmp_path) -> None:
    """The stock Trainer's ``optimizer.pt`` with one parameter's state dropped: Elixir refuses it before
    training, naming the parameter and the fix; with ``allow_missing_adam_state`` it loads (that
    parameter at step 0, as torch starts a parameter that never had a gradient)."""
    source, names = stock_checkpoint
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(source, ckpt)
    sd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    dropped = 3
    del sd["state"][dropped]
    torch.save(sd, ckpt / "optimizer.pt")

    args = dict(SAVE, max_steps=3)
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "refused"), OFFLOAD_PLAN, **args), n_train=32)
    with pytest.raises(CheckpointError, match="holds no Adam state for 1 trainable parameter") as err:
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert repr(names[dropped]) in str(err.value) and '{"allow_missing_adam_state": true}' in str(err.value)
    assert history(trainer, "loss", after_step=2) == []  # refused before any step

    allowed = OFFLOAD_PLAN[:-1] + ', "allow_missing_adam_state": true}'
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "allowed"), allowed, **args), n_train=32)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert len(history(trainer, "loss", after_step=2)) == 1


def test_convert_writes_the_state_of_a_parameter_that_never_had_a_gradient(elixir_checkpoint, tmp_path) -> None:
    """A parameter at step 0 (never a gradient: torch would keep no state) gets its state, step 0 and
    zero moments, so that a loader tells it from lost state."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(elixir_checkpoint, ckpt)
    index = json.loads((ckpt / OPTIM_INDEX).read_text())
    never = "transformer.h.0.attn.c_attn.bias"
    index["params"][never]["step"] = 0
    (ckpt / OPTIM_INDEX).write_text(json.dumps(index))
    model = make_trainer("gpt2", training_args(str(tmp_path / "m"))).model
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    state, _ = torch_adam_state(ckpt, model, lambda group: [position[id(p)] for p in group])
    assert sorted(state) == [position[id(p)] for _, p in model.named_parameters() if p.requires_grad]
    assert state[position[id(dict(model.named_parameters())[never])]]["step"].item() == 0
