"""Self-tests for the shared helpers: the gloo harness and the tiny models."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from helpers.dist import DistributedError, run_distributed
from helpers.models import MODEL_BUILDERS, make_batch, make_mlp_batch, tiny_mlp


# --- rank functions (module level so spawn can pickle them) -----------------


def _rank_sum(rank: int, world_size: int, scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item() * scale


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_in_collective(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one died before the collective")
    dist.barrier()  # rank 0 blocks here forever; the harness must not
    return rank


def _crash_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no Python exception, no report: like a segfault
    return rank


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


# --- harness ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_per_rank_values(world_size: int) -> None:
    out = run_distributed(_rank_sum, world_size, 10, timeout=120)
    expected_sum = sum(range(world_size)) * 10
    assert out == [(r, world_size, float(expected_sum)) for r in range(world_size)]


def test_exception_in_one_rank_is_reported() -> None:
    with pytest.raises(DistributedError, match="boom from rank one") as excinfo:
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert "rank 1" in str(excinfo.value)
    assert "ValueError" in str(excinfo.value)


def test_failed_rank_does_not_hang_peers() -> None:
    with pytest.raises(DistributedError, match="rank one died"):
        run_distributed(_hang_in_collective, 2, timeout=60)


def test_silent_crash_is_reported() -> None:
    with pytest.raises(DistributedError, match="exited with code 3"):
        run_distributed(_crash_rank_one, 2, timeout=60)


def test_timeout_kills_children() -> None:
    with pytest.raises(DistributedError, match="timed out"):
        run_distributed(_sleep_forever, 2, timeout=5)


# --- tiny models --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODEL_BUILDERS))
def test_tiny_model_finite_loss_and_deterministic(name: str) -> None:
    build = MODEL_BUILDERS[name]
    model = build(seed=0)
    batch = make_batch(model.config.vocab_size)
    loss = model(**batch).loss
    assert loss is not None and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    again = build(seed=0)(**batch).loss
    assert torch.equal(loss.detach(), again.detach())
    other = build(seed=1)(**batch).loss
    assert not torch.equal(loss.detach(), other.detach())


def test_tiny_gpt2_tie_option() -> None:
    tied = MODEL_BUILDERS["gpt2"](tie=True)
    untied = MODEL_BUILDERS["gpt2"](tie=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_tiny_mlp_options() -> None:
    model = tiny_mlp(unused_branch=True, freeze_first=True)
    batch = make_mlp_batch()
    out = model(**batch)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    assert model.unused is not None and model.unused.weight.grad is None
    assert not model.layers[0].weight.requires_grad and model.layers[0].weight.grad is None
    assert model.head.weight.grad is not None
    assert tiny_mlp().unused is None
