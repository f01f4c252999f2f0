"""No silent half-migration: every mix of Elixir and stock classes either trains fully with Elixir
or fails before training with the fix named. Code use of TRL: ``elixir_args(SFTConfig)`` keeps every
SFTConfig default and ``elixir_trainer(SFTTrainer)`` gives the stock losses."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import transformers.trainer
from hf_cases import OFFLOAD_PLAN, TokenDataset, history, make_trainer, save_tiny_lm, training_args
from transformers import Trainer, TrainingArguments

from elixir_hf import (
    ElixirAccelerator,
    ElixirSpecError,
    ElixirTrainer,
    ElixirTrainingArguments,
    elixir_args,
    elixir_trainer,
)
from helpers.models import tiny_gpt2

ROOT = Path(__file__).parents[2]
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELIXIR_CONFIG", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0
    assert all(math.isclose(g, w, rel_tol=RTOL) for g, w in zip(got, want)), (got, want)


def test_elixir_arguments_under_a_stock_trainer_fail_when_it_is_built(tmp_path) -> None:
    """The stock Trainer would drop --bf16 (the engine owns precision) and train without the engine."""
    args = training_args(str(tmp_path), "auto", bf16=True, max_steps=2, eval_strategy="no")
    with pytest.raises(ElixirSpecError, match="not an ElixirTrainer.*elixir_hf.elixir_trainer\\(YourTrainer\\)"):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(8))
    Trainer(
        model=tiny_gpt2(), args=training_args(str(tmp_path), "off", eval_strategy="no"), train_dataset=TokenDataset(8)
    )  # off: fine


def test_elixir_trainer_with_plain_arguments_reads_elixir_config(tmp_path, monkeypatch) -> None:
    plain = training_args(str(tmp_path / "plain"), max_steps=4, eval_strategy="no")
    assert type(plain) is TrainingArguments
    stock = make_trainer("gpt2", plain)
    stock.train()

    monkeypatch.setenv("ELIXIR_CONFIG", OFFLOAD_PLAN)
    ours = ElixirTrainer(model=tiny_gpt2(vocab=128), args=plain, train_dataset=TokenDataset(200))
    assert isinstance(ours.args, ElixirTrainingArguments) and ours.args.elixir_plugin.config.offload == 0.5
    assert ours.args.learning_rate == plain.learning_rate and type(plain) is TrainingArguments  # rebuilt, not changed
    ours.train()
    assert hasattr(ours.model, "_elixir")
    _close(history(ours, "loss"), history(stock, "loss"))

    monkeypatch.delenv("ELIXIR_CONFIG")
    off = ElixirTrainer(model=tiny_gpt2(vocab=128), args=plain, train_dataset=TokenDataset(8))
    assert off.args.elixir_plugin is None  # unset: off, as for ElixirTrainingArguments


def test_elixir_off_in_the_scripts_own_code_wins(tmp_path, monkeypatch) -> None:
    """A script run through elixir-run (``ELIXIR_CONFIG`` set) whose code says ``elixir="off"``. There
    the Trainer's ``Accelerator(...)`` builds an ``ElixirAccelerator``, which reads ``ELIXIR_CONFIG``
    when given no plugin; the arguments' off wins: no engine, the stock Trainer's losses."""
    monkeypatch.setenv("ELIXIR_CONFIG", OFFLOAD_PLAN)
    assert training_args(str(tmp_path), "off").elixir_plugin is None
    monkeypatch.setattr(transformers.trainer, "Accelerator", ElixirAccelerator)  # as elixir-run's classes build it
    args = training_args(str(tmp_path), "off", max_steps=3, eval_strategy="no")
    trainer = ElixirTrainer(model=tiny_gpt2(vocab=128), args=args, train_dataset=TokenDataset(200))
    assert isinstance(trainer.accelerator, ElixirAccelerator) and trainer.accelerator.elixir_plugin is None
    trainer.train()
    assert not hasattr(trainer.model, "_elixir") and len(history(trainer, "loss")) == 3


# --------------------------------------------------------------------------- TRL in code


def test_elixir_args_keep_every_sftconfig_default(tmp_path) -> None:
    from trl import SFTConfig

    ours, stock = (
        elixir_args(SFTConfig)(output_dir=str(tmp_path), elixir="auto", use_cpu=True),
        SFTConfig(output_dir=str(tmp_path), use_cpu=True),
    )
    assert (ours.learning_rate, ours.logging_steps, ours.gradient_checkpointing) == (2e-5, 10, True)
    for field in dataclasses.fields(stock):
        assert getattr(ours, field.name) == getattr(stock, field.name) or field.name == "mixed_precision", field.name
    assert ours.elixir_plugin is not None and isinstance(ours, SFTConfig)


def test_sft_trainer_in_code_gives_the_stock_losses(tmp_path) -> None:
    """``elixir_trainer(SFTTrainer)`` with ``elixir_args(SFTConfig)``: a full fine-tune (gradient
    checkpointing on, SFTConfig's default) with the stock SFTTrainer's losses and grad norms."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    folder = save_tiny_lm(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
    dataset = Dataset.from_dict(
        {"text": [" ".join(words[(5 * i + 3 * j) % len(words)] for j in range(12)) for i in range(16)]}
    )
    settings = dict(
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        adam_epsilon=1e-6,
        logging_steps=1,
        max_length=16,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    runs = {}
    for name, trainer_cls, args in (
        ("stock", SFTTrainer, SFTConfig(output_dir=str(tmp_path / "stock"), **settings)),
        (
            "elixir",
            elixir_trainer(SFTTrainer),
            elixir_args(SFTConfig)(output_dir=str(tmp_path / "e"), elixir=OFFLOAD_PLAN, **settings),
        ),
    ):
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        runs[name] = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        runs[name].train()
    assert hasattr(runs["elixir"].model, "_elixir") and runs["elixir"].args.gradient_checkpointing is True
    for key in ("loss", "grad_norm"):
        _close(history(runs["elixir"], key), history(runs["stock"], key))
