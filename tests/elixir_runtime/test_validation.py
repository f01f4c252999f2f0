"""Bad input fails in ``prepare`` (or ``ElixirConfig``) with a clear message, before any chunk
memory is allocated, and leaves the model exactly as it was."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elixir_runtime as er
import elixir_runtime.api as er_api
from helpers.dist import run_distributed
from helpers.models import make_batch, make_mlp_batch, tiny_gpt2, tiny_mlp

STATIC = dict(mode="static", n_blocks="min", offload=0.5)


def _adamw(model: nn.Module, **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, **kw)


@pytest.fixture
def no_allocation(monkeypatch):
    """Makes any allocation of the chunk runtime fail the test loudly (checks must come first)."""

    def forbidden(*_a, **_k):
        raise AssertionError("prepare allocated the chunk runtime before rejecting bad input")

    monkeypatch.setattr(er_api, "ChunkRuntime", forbidden)


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: (p.detach().clone(), p.data_ptr(), p.stride()) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _assert_untouched(model: nn.Module, snap: dict) -> None:
    assert not hasattr(model, "_elixir")
    for n, p in model.named_parameters():
        value, ptr, stride = snap["params"][n]
        assert not p.is_meta, n
        assert p.data_ptr() == ptr, f"{n} was re-pointed"
        assert p.stride() == stride and 0 not in p.stride(), f"{n} became a placeholder view"
        assert torch.equal(p.detach(), value), n
        assert not getattr(p, "_post_accumulate_grad_hooks", None), f"{n} got a grad hook"
    for n, b in model.named_buffers():
        assert torch.equal(b, snap["buffers"][n]), n
    for name, m in model.named_modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, f"hooks left on {name or '<root>'}"
        assert not m._state_dict_hooks and not m._load_state_dict_pre_hooks, f"state-dict hooks left on {name}"


def _expect_untouched_failure(model, optimizer, exc, match, config=None, batch=None):
    snap = _snapshot(model)
    with pytest.raises(exc, match=match):
        er.prepare(model, optimizer, config=config, example_batch=batch)
    _assert_untouched(model, snap)
    # the model still trains as a plain PyTorch model, giving the loss of an untouched copy
    if batch is not None:
        loss = model(**batch).loss
        loss.backward()
        assert torch.isfinite(loss)


# --------------------------------------------------------------------------- optimizer


def test_sgd_is_rejected(no_allocation) -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    _expect_untouched_failure(model, sgd, TypeError, r"Adam or AdamW.*SGD", er.ElixirConfig(**STATIC), batch)


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_unsupported_adam_flags_are_rejected(no_allocation, flag: str) -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    opt = _adamw(model, **{flag: True})
    _expect_untouched_failure(model, opt, ValueError, f"{flag}=True", er.ElixirConfig(**STATIC), batch)


def test_trainable_param_missing_from_optimizer(no_allocation) -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    skip = model.transformer.h[1].mlp.c_proj.bias
    opt = torch.optim.AdamW([p for p in model.parameters() if p is not skip], lr=1e-2)
    _expect_untouched_failure(
        model,
        opt,
        ValueError,
        r"not in the optimizer.*transformer\.h\.1\.mlp\.c_proj\.bias",
        er.ElixirConfig(**STATIC),
        batch,
    )


def test_optimizer_with_foreign_params(no_allocation) -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    opt = torch.optim.AdamW([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=1e-2)
    _expect_untouched_failure(model, opt, ValueError, "not in the model", er.ElixirConfig(**STATIC), batch)


def test_frozen_param_missing_from_optimizer_is_fine() -> None:
    model = tiny_gpt2()
    model.transformer.wpe.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    er.prepare(model, opt, config=er.ElixirConfig(**STATIC), example_batch=make_batch(128))
    assert hasattr(model, "_elixir")


# --------------------------------------------------------------------------- plan


@pytest.fixture(scope="module")
def min_blocks() -> int:
    """The smallest rCache of tiny GPT-2 under STATIC (from a successful prepare, before any patching)."""
    model = tiny_gpt2()
    model, _ = er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC), example_batch=make_batch(128))
    return model._elixir.plan.min_blocks


def test_rcache_below_minimum_is_plan_error(min_blocks, no_allocation) -> None:
    lo = min_blocks
    assert lo >= 2, "the test needs a unit spanning several chunks"
    model = tiny_gpt2()
    config = er.ElixirConfig(mode="static", n_blocks=lo - 1, offload=0.0)
    snap = _snapshot(model)
    with pytest.raises(er.PlanError, match=rf"n_blocks >= {lo}\b") as info:
        er.prepare(model, _adamw(model), config=config, example_batch=make_batch(128))
    assert isinstance(info.value, ValueError)  # PlanError is a ValueError
    _assert_untouched(model, snap)


def test_rcache_at_minimum_is_accepted(min_blocks) -> None:
    lo = min_blocks
    model = tiny_gpt2()
    config = er.ElixirConfig(mode="static", n_blocks=lo, offload=0.0)
    model, _ = er.prepare(model, _adamw(model), config=config, example_batch=make_batch(128))
    assert model._elixir.plan.n_blocks == lo


def test_offload_index_out_of_range(no_allocation) -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    config = er.ElixirConfig(mode="static", offload=[0, 999])
    _expect_untouched_failure(model, _adamw(model), er.PlanError, r"offload names chunks \[999\]", config, batch)


# --------------------------------------------------------------------------- model


@pytest.fixture
def gloo_group(tmp_path):
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_wrapped_model_is_rejected(gloo_group, no_allocation) -> None:
    from torch.nn.parallel import DistributedDataParallel

    inner = tiny_mlp()
    ddp = DistributedDataParallel(inner)
    snap = _snapshot(inner)
    with pytest.raises(TypeError, match=r"DistributedDataParallel.*model\.module"):
        er.prepare(ddp, _adamw(ddp), config=er.ElixirConfig(**STATIC), example_batch=make_mlp_batch())
    _assert_untouched(inner, snap)


def test_fsdp_sharded_model_is_rejected(gloo_group, no_allocation) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(TypeError, match="FSDP"):
        er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC), example_batch=make_mlp_batch())
    assert not hasattr(model, "_elixir")


def test_prepare_twice_is_rejected() -> None:
    model = tiny_gpt2()
    batch = make_batch(128)
    model, opt = er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC), example_batch=batch)
    state = model._elixir
    before = model.state_dict()
    with pytest.raises(ValueError, match="already prepared"):
        er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC), example_batch=batch)
    assert model._elixir is state
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the first engine still trains
    loss = model(**batch).loss
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    assert not torch.equal(
        model.state_dict()["transformer.h.0.mlp.c_fc.weight"], before["transformer.h.0.mlp.c_fc.weight"]
    )


def test_meta_params_are_rejected(no_allocation) -> None:
    with torch.device("meta"):
        model = tiny_gpt2()
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="meta device"):
        er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC))
    assert not hasattr(model, "_elixir")
    assert all(p.is_meta for p in model.parameters())


def test_partly_meta_model_is_rejected(no_allocation) -> None:
    model = tiny_gpt2()
    fc = model.transformer.h[0].mlp.c_fc
    fc.weight = nn.Parameter(torch.empty(fc.weight.shape, device="meta"))
    with pytest.raises(ValueError, match="with its parameters on meta"):
        er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC))
    assert not hasattr(model, "_elixir")


def _prepare_error(rank: int, _world: int, meta_rank: int, float64_rank: int | None) -> str | None:
    with torch.device("meta") if rank == meta_rank else contextlib.nullcontext():
        model = tiny_gpt2()
    if rank == float64_rank:
        model.to(torch.float64)
    try:
        er.prepare(model, _adamw(model), config=er.ElixirConfig(**STATIC))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "meta_rank, float64_rank, message",
    [(0, None, "rank 0 must hold the weights"), (1, 1, "rank 1's model differs from rank 0's")],
    ids=["meta-on-rank-0", "dtype-differs"],
)
def test_weights_from_rank_0_need_rank_0_and_one_model(meta_rank, float64_rank, message) -> None:
    """Every rank refuses together, before allocating: a lone rank raising would hang the others."""
    errors = run_distributed(_prepare_error, 2, meta_rank, float64_rank)
    assert all(e is not None and message in e for e in errors), errors


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="float8"), r"unknown dtype 'float8'"),
        (dict(dtype="int8"), r"unknown dtype"),
        (dict(dtype=torch.float64), r"float32, bfloat16 or float16"),
        (dict(offload=1.5), r"offload must be a fraction of the chunks in \[0, 1\]"),
        (dict(offload=-0.1), r"offload must be a fraction of the chunks in \[0, 1\]"),
        (dict(mode="fast"), r"mode must be 'auto'"),
        (dict(n_blocks="mid"), r"n_blocks must be an int >= 1 .*, 'min', 'max' or None, got 'mid'"),
        (dict(n_blocks=0), r"n_blocks must be an int >= 1.*got 0"),
        (dict(chunk_size=0), r"chunk_size must be a positive int.*got 0"),
        (dict(prefetch=-1), r"prefetch must be an int >= 0.*got -1"),
        (dict(cpu_threads=0), r"cpu_threads must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_config_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        er.ElixirConfig(**kwargs)


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("float32", torch.float32)])
def test_dtype_names_resolve(name: str, dtype: torch.dtype) -> None:
    assert er.ElixirConfig(dtype=name).dtype == dtype


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch) -> None:
    """``device="cuda"`` names the current GPU, as torch reads it (the memory probes need an index)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert er_api._resolve_device(er.ElixirConfig(device="cuda")) == torch.device("cuda", 3)
    assert er_api._resolve_device(er.ElixirConfig(device="cuda:1")) == torch.device("cuda", 1)
