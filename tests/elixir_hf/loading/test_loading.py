"""``elixir_hf.from_pretrained(..., stream=False)`` / ``from_config``: real weights on rank 0 (or
everywhere when ``rank0_only=False``), the identical model on meta on the other ranks, read from a
local folder as the hub path would be. Streaming (the default for such a folder): test_streaming.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import elixir_hf
from helpers.models import tiny_gpt2, tiny_llama


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-gpt2")
    tiny_gpt2(seed=3).save_pretrained(path)
    return str(path)


def _signature(model: torch.nn.Module) -> list[tuple]:
    return [(n, tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]]


def test_rank_0_loads_the_weights(saved, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    model = elixir_hf.from_pretrained(AutoModelForCausalLM, saved, stream=False, dtype=torch.float32)
    want = GPT2LMHeadModel.from_pretrained(saved, dtype=torch.float32)
    assert not any(p.is_meta for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_ranks_build_the_same_model_on_meta(saved, monkeypatch, dtype) -> None:
    rank0 = elixir_hf.from_pretrained(AutoModelForCausalLM, saved, stream=False, dtype=dtype)
    monkeypatch.setenv("RANK", "1")
    other = elixir_hf.from_pretrained(AutoModelForCausalLM, saved, stream=False, dtype=dtype)
    assert all(t.is_meta for _, t in [*other.named_parameters(), *other.named_buffers()])
    assert _signature(other) == _signature(rank0)
    assert other.lm_head.weight is other.transformer.wte.weight  # tied as on rank 0


def test_rank0_only_off_loads_on_every_rank(saved, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    model = elixir_hf.from_pretrained(GPT2LMHeadModel, saved, rank0_only=False)
    assert not any(p.is_meta for p in model.parameters())


def test_from_config_init_rank0_initialises_on_rank_0_only(monkeypatch) -> None:
    config = tiny_gpt2().config
    monkeypatch.setenv("RANK", "0")
    rank0 = elixir_hf.from_config(AutoModelForCausalLM, config, init="rank0")
    assert not any(p.is_meta for p in rank0.parameters())
    monkeypatch.setenv("RANK", "1")
    model = elixir_hf.from_config(GPT2LMHeadModel, config, init="rank0", dtype="auto")
    assert all(p.is_meta for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_from_config_builds_on_meta_on_every_rank_with_its_init(monkeypatch) -> None:
    """The default (test_init_in_place.py draws it): parameters on meta, buffers real, tied as built."""
    config = tiny_llama(tie=True).config
    monkeypatch.setenv("RANK", "0")
    model = elixir_hf.from_config(AutoModelForCausalLM, config, dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"from_config\(init='everywhere'\): choose one of"):
        elixir_hf.from_config(AutoModelForCausalLM, config, init="everywhere")
