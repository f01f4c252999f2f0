"""Checkpoints of ElixirTrainer: save -> resume continues bit-identically, the consolidated model
loads with ``from_pretrained`` (tied weights stored once) and gives the engine's logits, writes
leave no temporary files, and a checkpoint that cannot continue this run fails before training."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_cases import OFFLOAD_PLAN, VOCAB, history, make_trainer, training_args
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers.models import ATTN_IMPL, make_batch

SAVE = dict(max_steps=10, save_strategy="steps", save_steps=5, eval_strategy="no")


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """A 10-step Elixir run with checkpoints at steps 5 and 10; returns (run dir, losses)."""
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **SAVE))
    trainer.train()
    return out, history(trainer, "loss")


def test_checkpoint_files(saved_run) -> None:
    ckpt = saved_run[0] / "checkpoint-5"
    names = {p.name for p in ckpt.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "elixir_optim_rank0.pt",
        "scheduler.pt",
        "elixir_plan.json",
        "trainer_state.json",
        "rng_state.pth",
    } <= names
    assert "optimizer.pt" not in names
    assert not [n for n in names if n.startswith(".")], "temporary files left behind"
    plan = json.loads((ckpt / "elixir_plan.json").read_text())
    assert plan["world_size"] == 1 and plan["model"]["class"] == "GPT2LMHeadModel"
    shard = torch.load(ckpt / "elixir_optim_rank0.pt", weights_only=True)
    assert shard["world_size"] == 1 and shard["step"] == 5


def test_resume_gives_the_same_losses(saved_run, tmp_path) -> None:
    out, losses = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    resumed = make_trainer("gpt2", training_args(str(run), OFFLOAD_PLAN, **SAVE))
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-5"))
    assert history(resumed, "loss", after_step=5) == losses[5:]  # bit-identical on CPU/fp32


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_saved_model_loads_with_from_pretrained(tmp_path, model: str) -> None:
    trainer = make_trainer(model, training_args(str(tmp_path), OFFLOAD_PLAN, max_steps=3, eval_strategy="no"))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    with safe_open(str(tmp_path / "final" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    tied = trainer.model.config.tie_word_embeddings
    assert ("lm_head.weight" in keys) != tied, "a tied lm_head must be stored once, under the embedding's name"

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), attn_implementation=ATTN_IMPL).eval()
    if tied:
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    ids = make_batch(VOCAB)["input_ids"]
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not [p for p in (tmp_path / "final").iterdir() if p.name.startswith(".")]


def test_save_model_writes_the_plan_and_logs_the_final_folder(tmp_path) -> None:
    """The plan file lies beside the weights of ``save_model``'s output, not only in checkpoint-N/,
    and transformers' save messages name that folder, not the staging folder the files are written to."""
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "run"), OFFLOAD_PLAN, max_steps=1, eval_strategy="no"))
    trainer.train()
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(handler.format(record))
    tf_logger = logging.getLogger("transformers")
    tf_logger.addHandler(handler)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        trainer.save_model(str(tmp_path / "final"))
    finally:
        transformers.logging.set_verbosity(verbosity)
        tf_logger.removeHandler(handler)

    plan = json.loads((tmp_path / "final" / "elixir_plan.json").read_text())
    assert plan == {**json.loads(trainer.model._elixir.plan.to_json()), "model": plan["model"]}
    assert plan["model"]["class"] == "GPT2LMHeadModel" and plan["offload"]
    final = str(tmp_path / "final")
    assert any(m == f"Saving model checkpoint to {final}" for m in messages), messages
    assert any(final in m and "config.json" in m for m in messages), messages
    assert not [m for m in messages if ".elixir-save" in m], messages


def _resume(tmp_path: Path, saved: Path, model: str = "gpt2", **model_kwargs):
    trainer = make_trainer(model, training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **SAVE), **model_kwargs)
    return trainer.train(resume_from_checkpoint=str(saved))


@pytest.mark.parametrize("model, kwargs", [("gpt2", {"n_embd": 64}), ("llama", {})], ids=["wider-gpt2", "llama"])
def test_checkpoint_of_another_model_fails_clearly(saved_run, tmp_path, model: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="is from another model"):
        _resume(tmp_path, saved_run[0] / "checkpoint-5", model, **kwargs)


def test_checkpoint_of_another_world_size_fails_clearly(saved_run, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-5", ckpt)
    marker = json.loads((ckpt / "elixir_checkpoint.json").read_text())  # the marker records the ranks
    (ckpt / "elixir_checkpoint.json").write_text(json.dumps({**marker, "world_size": 2}))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\).*this run has 1.*--nproc_per_node 2"):
        _resume(tmp_path, ckpt)


def test_plain_optimizer_checkpoint_fails_clearly(tmp_path) -> None:
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE))
    stock.train()
    with pytest.raises(ValueError, match="plain PyTorch optimizer state.*--elixir off"):
        _resume(tmp_path, tmp_path / "stock" / "checkpoint-5")


def test_incomplete_checkpoint_fails_clearly(saved_run, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-5", ckpt)
    (ckpt / "scheduler.pt").unlink()
    with pytest.raises(ValueError, match="scheduler.pt is missing"):
        _resume(tmp_path, ckpt)
