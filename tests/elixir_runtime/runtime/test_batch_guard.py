"""A training batch larger than the plan's ``batch_shape`` (``elixir_runtime/runtime/batch_guard.py``):
the estimate of its activations bounds the profiler's, a batch the plan holds runs, one it cannot
hold is refused before its forward on every rank, and a plan without a profiled budget warns."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.plan import PlanMemory
from elixir_runtime.profiler.profile import profile_model
from elixir_runtime.runtime.batch_guard import BatchGuard, BatchShapeError, estimated_activations
from elixir_runtime.runtime.phase import Phase
from elixir_runtime.search.budget import Budget
from helpers.dist import run_distributed
from helpers.models import make_batch, tiny_gpt2, tiny_llama

VOCAB = 128
CONFIG = dict(mode="static", n_blocks="min", offload=0.5, device="cpu")
MIB = 2**20


def test_the_estimate_bounds_the_profiled_peak() -> None:
    """Against ``profile_model`` on a tiny Llama (checkpointed, bf16, CUDA's kernels emulated):
    twice the tokens by batch or by sequence, and 8x the sequence; linear in tokens alone falls short."""
    model = tiny_llama(n_positions=512)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # 5.17: the old name

    def peak(b: int, s: int) -> int:
        ids = torch.randint(3, 100, (b, s), generator=torch.Generator().manual_seed(0))
        return profile_model(
            model, {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cuda"
        ).activation_peak

    planned = (2, 32)
    base = peak(*planned)
    measured = {shape: peak(*shape) for shape in ((4, 32), (2, 64), (1, 256))}
    for shape, got in measured.items():
        assert estimated_activations(base, planned, shape) >= got, (shape, got)
    assert base * 2 < measured[2, 64]  # the sequence's quadratic parts: why the rule is not tokens alone


def test_the_rule() -> None:
    assert estimated_activations(100, (2, 32), (2, 32)) == 100
    assert estimated_activations(100, (2, 32), (4, 32)) == 200  # batch: linear
    assert estimated_activations(100, (2, 32), (2, 64)) == 400  # sequence: quadratic
    assert estimated_activations(100, (1, 64), (4, 32)) == 200  # more rows of shorter sequences: tokens
    assert estimated_activations(100, (2, 64), (8, 8)) == 100  # fewer tokens never under the profiled peak


def _plan(capacity: int, activations: int = 40 * MIB, device: int = 100 * MIB):
    model = tiny_gpt2(vocab=VOCAB)
    summary = profile_model(model, make_batch(VOCAB, device=torch.device("cpu")), device="cpu").summary()
    budget = Budget(capacity=capacity, activations=activations, buffers=0, host_capacity=2**34)
    static = er.ElixirPlan(
        chunk_size=1024, n_blocks=1, offload=(), n_chunks=1, world_size=1, dtype="float32", min_blocks=1, max_blocks=1
    )
    return dataclasses.replace(
        static,
        batch_shape=(2, 16),
        profile=summary,
        budget=budget,
        memory=PlanMemory(rcache=device, activations=activations),
    )


def test_the_guard_of_a_plan() -> None:
    """The room the budget leaves: (capacity - buffers - device / F_alloc) / F_frag; none without a profile."""
    plan = _plan(capacity=200 * MIB)
    guard = plan.batch_guard()
    assert guard.activations == 40 * MIB
    assert (
        guard.room == plan.activation_room == int((200 * MIB - 100 * MIB / 0.98) / 1.25)
    )  # 78.37 MiB: 1.96x the profiled peak
    guard.check([(2, 16), (3, 16)])  # 1.5x the tokens: held
    assert guard.held == 48
    with pytest.raises(BatchShapeError) as err:
        guard.check([(2, 16), (2, 24)])  # 1.5 x 1.5 = 2.25x: beyond
    msg = str(err.value)
    for part in ("rank 1's training batch is 2 x 24 = 48 tokens", "2 x 16 = 32", "90.00 MiB", "78.37 MiB"):
        assert part in msg, (part, msg)
    for fix in ("max_length", "max_seq_length", "elixir-plan --batch-size 2 --seq-len 24 --json > plan.json"):
        assert fix in msg
    assert "--elixir plan.json" in msg and "example batch" in msg
    assert isinstance(err.value, er.PlanError)
    static = dataclasses.replace(plan, profile=None, budget=None).batch_guard()
    assert static.room is None and static.planned == (2, 16)


def _prepared():
    model = tiny_gpt2(vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = er.prepare(
        model, optimizer, er.ElixirConfig(**CONFIG), example_batch=make_batch(VOCAB, device=torch.device("cpu"))
    )
    return model, optimizer


def _step(model, optimizer, batch) -> None:
    optimizer.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()


def _batch(b: int, s: int) -> dict[str, torch.Tensor]:
    return make_batch(VOCAB, batch=b, seq=s, device=torch.device("cpu"))


def test_a_static_plan_warns_once_and_a_budget_refuses_before_the_forward(caplog) -> None:
    model, optimizer = _prepared()
    root = model._elixir.hooks.root
    assert root.guard.planned == (2, 16) and root.guard.room is None  # static: no profiled budget
    with caplog.at_level(logging.WARNING, logger="elixir_runtime"):
        _step(model, optimizer, _batch(2, 32))
        _step(model, optimizer, _batch(2, 32))
    assert len([r for r in caplog.records if "batch_shape" in r.getMessage()]) == 1
    root.guard = BatchGuard((2, 16), activations=10 * MIB, room=25 * MIB)
    _step(model, optimizer, _batch(4, 16))  # 20 MiB estimated: runs
    with pytest.raises(BatchShapeError, match="2 x 32 = 64 tokens"):
        model(**_batch(2, 32))  # 40 MiB estimated
    assert root.depth == 0 and model._elixir.runtime.ctx.phase.now is Phase.IDLE
    _step(model, optimizer, _batch(2, 16))  # the run goes on with a batch the plan holds


def _one_rank_long(rank: int, _world: int) -> str:
    model, optimizer = _prepared()
    model._elixir.hooks.root.guard = BatchGuard((2, 16), activations=10 * MIB, room=25 * MIB)
    _step(model, optimizer, _batch(2, 16))
    try:
        model(**_batch(2, 32 if rank == 1 else 16))  # only rank 1's batch is too long
    except BatchShapeError as exc:
        return str(exc)
    raise AssertionError("not refused on this rank")


def test_a_batch_too_long_on_one_rank_is_refused_on_every_rank() -> None:
    msgs = run_distributed(_one_rank_long, 2, timeout=120)
    assert msgs[0] == msgs[1] and "rank 1's training batch is 2 x 32" in msgs[0]
