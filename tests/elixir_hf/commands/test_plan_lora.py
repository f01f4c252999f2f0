"""``elixir-plan --lora``: the PEFT model's parameters planned (its base frozen, its adapters trained),
LoRA among the ways to fit, and bad input to it named."""

from __future__ import annotations

import importlib.util
import json

import pytest

from elixir_hf.commands.plan import EXIT_INPUT, EXIT_NO_FIT, main

pytest.importorskip("peft")  # the dev extra has it; a user without it gets the extra's name (tested below)

GPT2 = ("--model", "gpt2", "--seq-len", "128", "--batch-size", "2", "--gpu", "h100", "--host-mem", "64GiB")
# GPT-2's LoRA parameters of rank r on all-linear (c_attn 768->2304, attn.c_proj 768->768, c_fc 768->3072,
# mlp.c_proj 3072->768, in each of its 12 blocks): r x (in + out) each
GPT2_LORA = 12 * ((768 + 2304) + (768 + 768) + (768 + 3072) + (3072 + 768))


def _plan(capsys, *argv: str) -> tuple[int, dict, str]:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_lora_plans_the_peft_model_base_frozen(capsys) -> None:
    code, full, _ = _plan(capsys, *GPT2)
    assert code == 0
    code, lora, _ = _plan(capsys, *GPT2, "--lora")
    assert code == 0
    assert lora["lora"] == {"rank": 16, "targets": "all-linear", "trainable": 16 * GPT2_LORA}
    chunks = lora["plan"]["chunks"]
    trained = [p for c in chunks if c["trainable"] for p in c["params"]]
    assert trained and all(".lora_A." in p or ".lora_B." in p for p in trained)
    assert sum(c["numel"] for c in chunks if c["trainable"]) == 16 * GPT2_LORA
    assert not any(".lora_" in p for c in chunks if not c["trainable"] for p in c["params"])
    # the frozen base holds its weights only: no fp32 master, gradients or Adam state (16 bytes a parameter)
    frozen = sum(c["numel"] for c in chunks if not c["trainable"])
    assert lora["plan"]["memory"]["device_shards"] < 2 * frozen + 20 * 16 * GPT2_LORA
    assert full["plan"]["memory"]["device_shards"] >= 12 * frozen  # fp32 master and moments on the GPU
    assert lora["profile"]["parameters"] == frozen + 16 * GPT2_LORA


def test_lora_rank_and_targets(capsys) -> None:
    code, doc, _ = _plan(capsys, *GPT2, "--lora-rank", "4", "--lora-targets", "c_attn")  # imply --lora
    assert code == 0
    assert doc["lora"] == {"rank": 4, "targets": ["c_attn"], "trainable": 4 * 12 * (768 + 2304)}


def test_lora_text_says_what_is_trained(capsys) -> None:
    assert main([*GPT2, "--lora"]) == 0
    out = capsys.readouterr().out
    assert f"LoRA rank 16 on every linear layer but the head: {16 * GPT2_LORA / 1e6:.1f} M parameters trained" in out


def test_unknown_lora_target_names_the_flag_and_the_layers(capsys) -> None:
    assert main([*GPT2, "--lora-targets", "q_proj"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert "--lora-targets q_proj" in err and "c_attn" in err and "c_fc" in err
    # before: planned in silence where another target named a module (PEFT refuses only where none does)
    assert main([*GPT2, "--lora-targets", "c_attn,q_proj"]) == EXIT_INPUT
    assert "elixir-plan: --lora-targets c_attn,q_proj: q_proj names no module of the model; this model's linear" in (
        capsys.readouterr().err
    )


def test_lora_without_peft_names_the_extra(monkeypatch, capsys) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit:
        main([*GPT2, "--lora"])
    assert exit.value.code == EXIT_INPUT
    assert "--lora needs peft: pip install 'elixir-hf[trl]'" in capsys.readouterr().err


def test_no_fit_names_lora_and_lora_fits(capsys) -> None:
    box = ("--model", "gpt2-xl", "--seq-len", "256", "--batch-size", "1", "--gpu-mem", "8GiB", "--host-mem", "4GiB")
    assert main([*box, "--gpu", "h100"]) == EXIT_NO_FIT
    assert "a LoRA fine-tune instead of a full one (--lora plans it)" in capsys.readouterr().err
    assert main([*box, "--gpu", "h100", "--lora"]) == 0
