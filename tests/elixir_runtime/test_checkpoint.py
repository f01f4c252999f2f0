"""Checkpoints: consolidated model state dict from any layout, loading it back, the optimizer state
by parameter name, save -> load -> continue equal to an uninterrupted run, and the HF save/load round trip.

Parity runs use Adam eps=1e-6: with eps=1e-8, Adam turns pure round-off gradients (e.g. GPT-2's
attention key bias, whose true gradient is 0) into lr-sized steps, and two runs that differ only
in summation order stop agreeing to 1e-6.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import elixir_runtime as er
from helpers.device import local_device
from helpers.dist import run_distributed
from helpers.models import ATTN_IMPL, MODEL_BUILDERS, make_batch, tiny_gpt2
from helpers.training import max_weight_diff

LAYOUTS = {
    "min-half-offload": dict(n_blocks="min", offload=0.5),
    "max-no-offload": dict(n_blocks="max", offload=0.0),
    "big-chunks-full-offload": dict(n_blocks="min", offload=1.0, chunk_size=8192),
}
DEFAULT = LAYOUTS["min-half-offload"]


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _prepare(model, batch, **cfg):
    config = er.ElixirConfig(mode="static", **{**DEFAULT, **cfg})
    return er.prepare(model, _adamw(model), config=config, example_batch=batch)


def _train(model, opt, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _batches(vocab: int, steps: range, rank: int = 0) -> list[dict[str, torch.Tensor]]:
    return [make_batch(vocab, seed=100 * s + rank) for s in steps]


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"]).logits


# --------------------------------------------------------------------------- (a) state_dict


@pytest.mark.parametrize("name", sorted(MODEL_BUILDERS))
def test_consolidated_state_dict_matches_plain(name: str) -> None:
    build = MODEL_BUILDERS[name]
    plain = build(seed=0)
    expected = plain.state_dict()
    model = build(seed=0)
    model, _ = _prepare(model, make_batch(model.config.vocab_size))
    sd = model.state_dict()
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert sd[k].shape == v.shape, k
        assert sd[k].dtype == v.dtype, k
        assert sd[k].device.type == "cpu", k
        assert torch.equal(sd[k], v), k
    if plain.config.tie_word_embeddings:
        emb = plain.get_input_embeddings().weight
        names = [n for n, p in plain.named_parameters(remove_duplicate=False) if p is emb]
        assert len(names) == 2, names
        a, b = (sd[n] for n in names)
        assert a.data_ptr() == b.data_ptr(), "tied weights must come back as one tensor"
    # a second call (after the first gathered everything) gives the same values
    sd2 = model.state_dict()
    assert all(torch.equal(sd2[k], expected[k]) for k in expected)


# --------------------------------------------------------------------------- (b) load_state_dict


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_load_plain_state_dict_gives_plain_logits(name: str, layout: str) -> None:
    build = MODEL_BUILDERS[name]
    source = build(seed=7, device=local_device())
    batch = make_batch(source.config.vocab_size)
    source.eval()
    want = _logits(source, batch)

    model = build(seed=0)
    model, _ = _prepare(model, batch, **LAYOUTS[layout])
    model.eval()
    before = _logits(model, batch)
    assert not torch.allclose(before, want, atol=1e-3), "test needs two different models"
    result = model.load_state_dict(source.state_dict(), strict=True)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    torch.testing.assert_close(_logits(model, batch), want, rtol=0, atol=1e-6)
    sd = model.state_dict()
    for k, v in source.state_dict().items():
        assert torch.equal(sd[k], v.cpu()), k


def test_load_without_tied_lm_head_is_strict_ok() -> None:
    source = tiny_gpt2(seed=3, device=local_device())
    batch = make_batch(source.config.vocab_size)
    source.eval()
    want = _logits(source, batch)
    hf_format = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}

    model = tiny_gpt2(seed=0)
    model, _ = _prepare(model, batch)
    model.eval()
    result = model.load_state_dict(hf_format, strict=True)
    assert list(result.missing_keys) == []
    torch.testing.assert_close(_logits(model, batch), want, rtol=0, atol=1e-6)
    sd = model.state_dict()
    assert torch.equal(sd["lm_head.weight"], source.transformer.wte.weight.detach().cpu())


def test_load_missing_untied_key_fails_strict() -> None:
    # the alias rule must not hide a genuinely missing weight
    source = MODEL_BUILDERS["llama"](seed=3)
    batch = make_batch(source.config.vocab_size)
    model = MODEL_BUILDERS["llama"](seed=0)
    model, _ = _prepare(model, batch)
    sd = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        model.load_state_dict(sd, strict=True)


def test_load_wrong_shape_is_size_mismatch() -> None:
    model = tiny_gpt2(seed=0)
    batch = make_batch(model.config.vocab_size)
    model, _ = _prepare(model, batch)
    sd = tiny_gpt2(seed=1).state_dict()
    sd["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(3, 5)
    with pytest.raises(RuntimeError, match="size mismatch for transformer.h.0.mlp.c_fc.weight"):
        model.load_state_dict(sd)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_load_safetensors_streams_to_the_same_model(tmp_path, name: str) -> None:
    """HF's file (tied lm_head not stored), a tensor at a time: the same logits as the source."""
    source = MODEL_BUILDERS[name](seed=7, device=local_device()).eval()
    source.save_pretrained(tmp_path)
    batch = make_batch(source.config.vocab_size)
    model, _ = _prepare(MODEL_BUILDERS[name](seed=0), batch, **LAYOUTS["big-chunks-full-offload"])
    model.eval()
    assert not torch.allclose(_logits(model, batch), _logits(source, batch), atol=1e-3)
    er.load_safetensors(model, str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(_logits(model, batch), _logits(source, batch), rtol=0, atol=1e-6)


def test_load_safetensors_is_strict(tmp_path) -> None:
    from safetensors.torch import save_file

    model, _ = _prepare(tiny_gpt2(seed=0), make_batch(128))
    sd = {k: v.contiguous() for k, v in tiny_gpt2(seed=1).state_dict().items() if k != "lm_head.weight"}
    save_file({**sd, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra.weight'\]"):
        er.load_safetensors(model, str(tmp_path / "extra.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "transformer.h.0.mlp.c_fc.bias"}, tmp_path / "missing.safetensors")
    with pytest.raises(RuntimeError, match="missing keys .*transformer.h.0.mlp.c_fc.bias"):
        er.load_safetensors(model, str(tmp_path / "missing.safetensors"))
    save_file({**sd, "transformer.h.0.mlp.c_fc.weight": torch.zeros(3, 5)}, tmp_path / "shape.safetensors")
    with pytest.raises(RuntimeError, match="size mismatch for transformer.h.0.mlp.c_fc.weight"):
        er.load_safetensors(model, str(tmp_path / "shape.safetensors"))


# --------------------------------------------------------------------------- (c) resume


def _resume_run(
    tmp: str, build_name: str, rank: int = 0, load_optimizer: bool = True
) -> tuple[list[float], list[float]]:
    """(uninterrupted 6 steps, 3 steps + save + fresh engine + load + 3 steps) losses on this rank."""
    build = MODEL_BUILDERS[build_name]
    vocab = build().config.vocab_size
    first, second = _batches(vocab, range(3), rank), _batches(vocab, range(3, 6), rank)

    model, opt = _prepare(build(seed=0), first[0])
    straight = _train(model, opt, first + second)

    model, opt = _prepare(build(seed=0), first[0])
    resumed = _train(model, opt, first)
    model_path = os.path.join(tmp, "model.pt")
    with er.rank0_state_dict(model):
        sd = model.state_dict()  # collective: every rank; only rank 0 keeps the weights
    if rank == 0:
        torch.save(sd, model_path)
    torch.save(opt.state_dict(), os.path.join(tmp, f"optim.rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
    del model, opt

    fresh, opt = _prepare(build(seed=123), first[0])  # different init: the load must matter
    fresh.load_state_dict(torch.load(model_path), strict=True)
    if load_optimizer:
        opt.load_state_dict(torch.load(os.path.join(tmp, f"optim.rank{rank}.pt")))
    resumed += _train(fresh, opt, second)
    return straight, resumed


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_save_load_continue_world1(tmp_path, name: str) -> None:
    straight, resumed = _resume_run(str(tmp_path), name)
    assert len(resumed) == 6
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=0, atol=1e-6)
    # the optimizer state matters: resuming with fresh Adam moments (and step count) diverges
    _, weights_only = _resume_run(str(tmp_path), name, load_optimizer=False)
    assert weights_only[:4] == pytest.approx(straight[:4], abs=1e-6)  # step 4 uses only the loaded weights
    assert abs(weights_only[4] - straight[4]) > 1e-4


def _resume_world2(rank: int, world_size: int, tmp: str) -> dict:
    straight, resumed = _resume_run(tmp, "gpt2", rank)
    # (e) the world-1 run's state holds every element: each rank of 2 takes its pieces of it by name;
    # the other rank's state does not hold this rank's pieces, and is refused
    _, opt = _prepare(tiny_gpt2(seed=0), make_batch(128))
    world1 = torch.load(os.path.join(tmp, "world1_optim.pt"))
    opt.load_state_dict(world1)
    tensors, pieces = er.named_state(opt)
    loaded = all(
        torch.equal(t, world1["tensors"][key][slice(*pieces[key.rsplit(".", 1)[0]])]) for key, t in tensors.items()
    )
    try:
        opt.load_state_dict(torch.load(os.path.join(tmp, f"optim.rank{1 - rank}.pt")))
        error = None
    except ValueError as e:
        error = str(e)
    return {"straight": straight, "resumed": resumed, "world1_loaded": loaded and opt.step_count == 1, "error": error}


def _state_dicts(rank: int, world_size: int) -> tuple[dict, dict]:
    model, opt = _prepare(tiny_gpt2(seed=0), make_batch(128))
    _train(model, opt, _batches(128, range(2), rank))
    everywhere = model.state_dict()
    with er.rank0_state_dict(model):
        on_rank0 = model.state_dict()
    return everywhere, on_rank0


def test_rank0_state_dict_keeps_the_weights_on_rank_0_only() -> None:
    (full0, only0), (full1, only1) = run_distributed(_state_dicts, 2)
    params = {n for n, _ in tiny_gpt2().named_parameters(remove_duplicate=False)}
    assert params <= set(full0) and max_weight_diff(full0, full1) == 0.0  # the default: every rank
    assert only0.keys() == full0.keys() and max_weight_diff(only0, full0) == 0.0
    assert not params & set(only1)  # rank 1 holds none of the weights


def test_save_load_continue_world2(tmp_path) -> None:
    # a world-1 state for the cross-world-size load inside the ranks
    model, opt = _prepare(tiny_gpt2(seed=0), make_batch(128))
    _train(model, opt, _batches(128, range(1)))
    torch.save(opt.state_dict(), tmp_path / "world1_optim.pt")

    results = run_distributed(_resume_world2, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["straight"]), rtol=0, atol=1e-6)
        assert r["world1_loaded"]
        assert r["error"] is not None and f"(rank {1 - rank} of 2 saved it) and this rank ({rank} of 2)" in r["error"]
    # the ranks saw different data, so their losses differ: the test really ran two shards
    assert results[0]["straight"] != results[1]["straight"]


# --------------------------------------------------------------------------- (d) HF round trip


def test_save_pretrained_round_trip(tmp_path) -> None:
    model = tiny_gpt2(seed=0)
    batch = make_batch(model.config.vocab_size)
    model, opt = _prepare(model, batch)
    _train(model, opt, _batches(model.config.vocab_size, range(2)))
    model.eval()
    want = _logits(model, batch)

    # transformers 5 always writes safetensors (the old safe_serialization flag is gone)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files, os.listdir(tmp_path)
    keys: set[str] = set()
    for f in files:
        with safe_open(str(tmp_path / f), framework="pt") as st:
            keys.update(st.keys())
    assert "lm_head.weight" not in keys, "tied lm_head must be written once (as wte)"
    assert "transformer.wte.weight" in keys

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTN_IMPL).to(local_device())
    loaded.eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    torch.testing.assert_close(_logits(loaded, batch), want, rtol=0, atol=1e-6)
    # and the trained weights really moved away from the initial ones
    init = tiny_gpt2(seed=0).state_dict()
    assert not torch.equal(
        loaded.state_dict()["transformer.h.0.mlp.c_fc.weight"].cpu(), init["transformer.h.0.mlp.c_fc.weight"]
    )


# --------------------------------------------------------------------------- (e) bad optimizer loads


def test_optimizer_state_loads_by_name_into_another_layout() -> None:
    """Another chunk size and every chunk offloaded: the state goes to each parameter by its name."""
    batch = make_batch(128)
    model, opt = _prepare(tiny_gpt2(seed=0), batch)
    _train(model, opt, [batch])
    saved = opt.state_dict()
    assert saved["format"] == "elixir-optimizer-state/1" and saved["step"] == 1
    assert {k.rsplit(".", 1)[1] for k in saved["tensors"]} == {"master", "exp_avg", "exp_avg_sq"}

    _, other = _prepare(tiny_gpt2(seed=1), batch, **LAYOUTS["big-chunks-full-offload"])
    other.load_state_dict(saved)
    tensors, pieces = er.named_state(other)
    assert pieces == saved["pieces"] and other.step_count == 1
    assert all(torch.equal(t, saved["tensors"][k]) for k, t in tensors.items())


def test_plain_torch_optimizer_state_is_rejected() -> None:
    plain = tiny_gpt2(seed=0, device=local_device())
    batch = make_batch(128)
    plain_opt = _adamw(plain)
    plain(**batch).loss.backward()
    plain_opt.step()

    _, opt = _prepare(tiny_gpt2(seed=0), batch)
    with pytest.raises(ValueError, match="a plain torch optimizer's; elixir_runtime.plain_to_named"):
        opt.load_state_dict(plain_opt.state_dict())


def test_state_without_this_ranks_pieces_is_rejected_before_any_copy() -> None:
    # what rank 1 of 2 holds of a parameter (its second half) does not cover this one rank's whole range
    batch = make_batch(128)
    _, opt = _prepare(tiny_gpt2(seed=0), batch)
    saved = opt.state_dict()
    before = {k: t.clone() for k, t in er.named_state(opt)[0].items()}
    name = "transformer.h.0.mlp.c_fc.weight"
    half = saved["pieces"][name][1] // 2
    saved.update(rank=1, world_size=2, step=7)
    saved["pieces"][name] = [half, 2 * half]
    saved["tensors"] = {k: (t[half:] if k.startswith(name + ".") else t) * 0 for k, t in saved["tensors"].items()}
    with pytest.raises(
        ValueError, match=rf"holds elements \[{half}, {2 * half}\) of '{name}' \(rank 1 of 2 saved it\)"
    ):
        opt.load_state_dict(saved)
    assert opt.step_count == 0
    assert all(torch.equal(t, before[k]) for k, t in er.named_state(opt)[0].items())


def test_per_rank_shard_of_0_1_0_is_refused_by_its_format() -> None:
    """What ``state_dict()`` returned up to 0.1.0: the message names the format and the version that reads it."""
    _, opt = _prepare(tiny_gpt2(seed=0), make_batch(128))
    legacy = {"format": "elixir-optimizer-shard/1", "rank": 0, "world_size": 1, "step": 3, "chunks": {}}
    with pytest.raises(ValueError, match=r"'elixir-optimizer-shard/1'.*pip install elixir-hf==0\.1\.0"):
        opt.load_state_dict(legacy)
