"""``elixir_hf.from_config``'s default: the model on meta on every rank carrying transformers' init,
drawn by ``prepare`` on each rank's shards. The weights have the init's distribution per parameter
(N(0, 0.02), GPT-2's scaled projections, norms 1, biases 0, the padding row 0), are bitwise the same
at 1 and 2 gloo ranks and any chunk size for one seed, tied weights stay one, no read is larger than
a chunk shard and the parameters stay on meta until ``prepare``; training starts at ln(vocab) like
transformers' own init. An init that cannot be drawn a range at a time is refused naming the parameter."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama

import elixir_hf
import elixir_runtime as er
from elixir_runtime.weights.attached import attached_weights
from helpers.dist import run_distributed
from helpers.models import ATTN_IMPL, make_batch, tiny_gpt2, tiny_llama

VOCAB = 128
CASES = {"llama": (tiny_llama, {}), "llama-tied": (tiny_llama, {"tie": True}), "gpt2-tied": (tiny_gpt2, {})}


def _build(case: str, **kwargs):
    build, extra = CASES[case]
    config = build(**extra, **kwargs).config
    return elixir_hf.from_config(AutoModelForCausalLM, config, seed=11, attn_implementation=ATTN_IMPL)


def _prepare(rank: int, world_size: int, case: str, chunk_size: int, steps: int = 0) -> dict:
    model = _build(case)
    assert all(p.is_meta for p in model.parameters())
    reads: list[int] = []
    source = attached_weights(model)
    read = source.read
    source.read = lambda p, start, numel, *rest: reads.append(numel) or read(p, start, numel, *rest)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v[rank::world_size] for k, v in make_batch(VOCAB, 4, 16).items()}  # one batch, split over the ranks
    config = er.ElixirConfig(mode="static", device="cpu", chunk_size=chunk_size, offload=0.5)
    model, opt = er.prepare(model, opt, config, batch)
    layout = model._elixir.live.layout
    out = {"start": model.state_dict(), "losses": []}
    for _ in range(steps):
        loss = model(**batch).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["largest_read"], out["largest_shard"] = max(reads), max(layout.shard_numel(c) for c in layout.chunks)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_weights_at_any_chunk_size(case) -> None:
    a, b = (_prepare(0, 1, case, size) for size in (1024, 4096))
    assert a["start"].keys() == b["start"].keys()
    for name, value in a["start"].items():
        assert torch.equal(value, b["start"][name]), name
    assert a["largest_read"] <= a["largest_shard"]
    if "tied" in case:
        assert a["start"]["lm_head.weight"] is next(v for k, v in a["start"].items() if "emb" in k or "wte" in k)


def test_the_same_weights_and_training_at_one_and_two_ranks() -> None:
    one = _prepare(0, 1, "llama", 2048, steps=2)
    two = run_distributed(_prepare, 2, "llama", 2048, 2)
    for name, value in one["start"].items():
        assert torch.equal(value, two[0]["start"][name]), name
    assert all(r["largest_read"] <= r["largest_shard"] for r in two)
    both = [(a + b) / 2 for a, b in zip(two[0]["losses"], two[1]["losses"])]  # each rank's half of one batch
    assert both == pytest.approx(one["losses"], abs=1e-4)
    assert abs(one["losses"][0] - math.log(VOCAB)) < 0.05 and one["losses"][1] < one["losses"][0]


@pytest.mark.parametrize("case", ["llama", "gpt2-tied"])
def test_each_parameter_has_transformers_init_distribution(case) -> None:
    big = dict(n_embd=128, vocab=1024, n_layer=2)
    model = _build(case, **big)
    std = model.config.initializer_range
    source = attached_weights(model)
    stock = CASES[case][0](**big)  # transformers' own init of the same config, for the loss
    for name, p in model.named_parameters():
        v = source.read(p, 0, p.numel()).view(p.shape)
        if name.endswith("bias"):
            assert torch.all(v == 0), name
        elif "norm" in name or ".ln_" in name or "ln_f" in name:
            assert torch.all(v == 1), name
        else:
            want = std / math.sqrt(2 * model.config.n_layer) if name.endswith("c_proj.weight") else std
            rows = v[1:] if "embed_tokens" in name else v  # the padding row is 0
            assert abs(rows.mean().item()) < 4 * want / math.sqrt(rows.numel()), name
            assert abs(rows.std().item() / want - 1) < 0.05, name
            if "embed_tokens" in name:
                assert torch.all(v[model.config.pad_token_id] == 0)
    batch = make_batch(1024, 4, 32)
    with torch.no_grad():
        want = stock(**batch).loss.item()
    got = _prepare_loss(model, batch)
    assert abs(got - math.log(1024)) < 0.05 and abs(got - want) < 0.05


def _prepare_loss(model, batch) -> float:
    model, _ = er.prepare(model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(mode="static", device="cpu"))
    with torch.no_grad():
        return model(**batch).loss.item()


def test_an_init_that_cannot_be_drawn_per_range_is_refused(monkeypatch) -> None:
    stock = modeling_llama.LlamaPreTrainedModel._init_weights

    def orthogonal_q(self, module):
        stock(self, module)
        if isinstance(module, torch.nn.Linear) and module.out_features == module.in_features:
            torch.nn.init.orthogonal_(module.weight)

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", orthogonal_q)
    with pytest.raises(er.InitError, match=r"parameter 'model\.layers\.0\.self_attn\.q_proj\.weight' .* aten\.copy_"):
        _build("llama")
    config = tiny_llama().config  # the old path still builds it: rank 0 initialises the whole model
    assert not any(p.is_meta for p in elixir_hf.from_config(AutoModelForCausalLM, config, init="rank0").parameters())
