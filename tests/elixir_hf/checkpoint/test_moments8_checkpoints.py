"""Checkpoints of an ElixirTrainer run with ``moments: "8bit"``: the codes and scales in the optimizer
files, resume bit for bit (also on another plan), resume as exact (dequantized, logged), ``elixir-convert``
to plain fp32 AdamW state, and a damaged scale refused by the checkpoint's sums, by name."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hf_cases import history, make_trainer, training_args
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elixir_hf.checkpoint.format import CheckpointError
from elixir_hf.commands import convert
from elixir_runtime.kernels import quant8

SAVE = dict(max_steps=8, save_strategy="steps", save_steps=4, eval_strategy="no")
EIGHT = '{"mode": "static", "n_blocks": "min", "offload": 0.5, "moments": "8bit"}'
OPTIM = "optimizer-00000-of-00001.safetensors"


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[float]]:
    out = tmp_path_factory.mktemp("run8")
    trainer = make_trainer("gpt2", training_args(str(out), EIGHT, **SAVE))
    trainer.train()
    return out, history(trainer, "loss")


def test_the_optimizer_files_hold_codes_and_scales(saved_run) -> None:
    ckpt = saved_run[0] / "checkpoint-4"
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    assert index["moments"] == "8bit"
    name = "transformer.h.0.mlp.c_fc.weight"
    numel = index["params"][name]["pieces"][0][2]
    with safe_open(str(ckpt / OPTIM), framework="pt") as f:
        assert f.get_tensor(f"{name}.exp_avg").dtype == torch.uint8 and f.get_tensor(f"{name}.exp_avg").numel() == numel
        assert f.get_tensor(f"{name}.exp_avg_sq.absmax").shape == (-(-numel // 256),)
        assert f.get_tensor(f"{name}.master").dtype == torch.float32


@pytest.mark.parametrize("plan", [EIGHT, '{"mode": "static", "n_blocks": "max", "offload": 0.0, "moments": "8bit"}'])
def test_resume_continues_the_run(saved_run, tmp_path, plan: str) -> None:
    """Same plan: bit for bit; another (nothing offloaded, every block cached): the same state loaded
    bit for bit, the losses within float rounding of the gradient norm's summation order."""
    out, losses = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    resumed = make_trainer("gpt2", training_args(str(run), plan, **SAVE))
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    if plan == EIGHT:
        assert history(resumed, "loss", after_step=4) == losses[4:]
    else:
        assert history(resumed, "loss", after_step=4) == pytest.approx(losses[4:], rel=1e-5)


def test_resume_as_exact_dequantizes_and_says_so(saved_run, tmp_path, caplog) -> None:
    out, losses = saved_run
    exact = make_trainer("gpt2", training_args(str(tmp_path / "exact"), EIGHT.replace("8bit", "fp32"), **SAVE))
    with caplog.at_level(logging.WARNING):
        exact.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert "holds 8bit moments and this run keeps fp32: dequantized to fp32 on load" in caplog.text
    assert history(exact, "loss", after_step=4) == pytest.approx(losses[4:], rel=1e-3)


def test_convert_writes_plain_fp32_adamw_state(saved_run, tmp_path) -> None:
    """The moments dequantized, as fp32 tensors of the parameter's shape, numbered in
    ``model.parameters()`` order; the stock Trainer resumes from them."""
    from transformers import AutoModelForCausalLM

    ckpt, plain, name = saved_run[0] / "checkpoint-4", tmp_path / "plain", "transformer.h.0.mlp.c_fc.weight"
    convert.main([str(ckpt), str(plain)])
    sd = torch.load(plain / "optimizer.pt", weights_only=True)
    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(plain).named_parameters()]
    state = sd["state"][names.index(name)]
    with safe_open(str(ckpt / OPTIM), framework="pt") as f:
        for kind in quant8.MOMENT_KINDS:
            want = quant8.dequantize(kind, f.get_tensor(f"{name}.{kind}"), f.get_tensor(f"{name}.{kind}.absmax"))
            assert state[kind].dtype == torch.float32 and torch.equal(state[kind].flatten(), want)
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE))
    stock.train(resume_from_checkpoint=str(plain))  # a stock Trainer checkpoint


def test_a_damaged_scale_is_refused_by_name(saved_run, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-4", ckpt)
    tensors = load_file(str(ckpt / OPTIM))
    key = "transformer.h.0.mlp.c_fc.weight.exp_avg.absmax"
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(ckpt / OPTIM), metadata={"global_step": "4"})
    resumed = make_trainer("gpt2", training_args(str(tmp_path / "resumed"), EIGHT, **SAVE))
    with pytest.raises(CheckpointError, match=OPTIM):
        resumed.train(resume_from_checkpoint=str(ckpt))
