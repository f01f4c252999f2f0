"""Elixir vs plain PyTorch: same model, data, seed and AdamW → same losses and weights.

Plan shapes cover rCache min/mid/max × offload 0/50/100 %, on 1, 2 and 4 ranks (gloo), with
GA 1 and 3, clipping, GPT-2 (tied) / OPT / Llama (also with chunks smaller than its untied
embedding and lm_head, which then get chunks of their own), activation checkpointing off /
non-reentrant / reentrant. fp32 runs must agree to 1e-6 (losses, relative) and 1e-5 (weights, absolute, for
weights that moved ~0.1 over 20 steps at lr 1e-2): the only differences are summation orders.
A wrong gradient, a dropped micro-step or a stale gathered chunk shows up as 1e-3 or more.
Multi-rank runs take 8 steps (24 micro-steps at GA 3): what the ranks add (averaged gradients, shards,
every rank's gathers and evictions in the same order) is wrong from the first step if at all, and
the 20-step drift is the single-rank runs' to show; 4 ranks share 2 cores in CI.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import elixir_runtime as er
from helpers.dist import run_distributed
from helpers.training import (
    Recipe,
    assert_close_losses,
    batch_for,
    build,
    lr_at,
    max_weight_diff,
    run_elixir,
    run_reference,
)

# (n_blocks, offload): rCache min with everything offloaded, a middle point, rCache max on device.
PLAN_SHAPES = [("min", 1.0), (None, 0.5), ("max", 0.0)]
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-5
MULTI_RANK_STEPS = 8

OVERSIZE_CHUNK = 2048
"""Below tiny Llama's untied embedding and lm_head (128 x 32 = 4096 elements each), above its largest
block weight (64 x 32): those two get private chunks of their own, the blocks are packed at 2048."""


@pytest.mark.parametrize("model", ["gpt2", "opt", "llama"])
@pytest.mark.parametrize("ac", [None, False, True], ids=["ac-off", "ac-nonreentrant", "ac-reentrant"])
@pytest.mark.parametrize("grad_accum", [1, 3], ids=["ga1", "ga3"])
def test_single_rank_matches_pytorch(model, ac, grad_accum):
    recipe = Recipe(model=model, ac=ac, grad_accum=grad_accum)
    want = run_reference(recipe)
    for n_blocks, offload in PLAN_SHAPES:
        got = run_elixir(recipe, n_blocks=n_blocks or "mid", offload=offload)
        assert_close_losses(got.losses, want.losses, LOSS_RTOL)
        diff = max_weight_diff(got.state, want.state)
        assert diff < WEIGHT_ATOL, (n_blocks, offload, diff)
        if n_blocks == "min":  # the small rCache really evicts and re-gathers
            assert got.stats["evictions"] > 0 and got.stats["prefetches"] > 0


def _rank_runs(rank: int, world_size: int, recipes: list[Recipe], shapes: list[tuple]) -> list:
    """``shapes``: ``(n_blocks, offload)``, or ``(n_blocks, offload, chunk_size)``."""
    return [
        run_elixir(r, rank, n_blocks=nb or "mid", offload=off, chunk_size=(rest or [None])[0])
        for r, (nb, off, *rest) in zip(recipes, shapes)
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_matches_pytorch(world_size):
    cases = [
        (Recipe(model=m, ac=ac, grad_accum=ga, world_size=world_size, steps=MULTI_RANK_STEPS), shape)
        for (m, ac, ga), shape in zip(
            itertools.product(["gpt2", "opt", "llama"], [False], [1, 3])
            if world_size == 2
            else [("gpt2", False, 3), ("llama", True, 1), ("opt", None, 3)],
            itertools.cycle(PLAN_SHAPES),
        )
    ]
    if world_size == 2:  # embedding and lm_head in chunks of their own (test_params_larger_than_a_chunk_...)
        cases += [
            (Recipe(model="llama", ac=ac, grad_accum=ga, world_size=2, steps=8), (*shape, OVERSIZE_CHUNK))
            for (ac, ga), shape in zip([(False, 1), (True, 3), (None, 1)], PLAN_SHAPES)
        ]
    recipes = [r for r, _ in cases]
    results = run_distributed(_rank_runs, world_size, recipes, [s for _, s in cases])
    for i, recipe in enumerate(recipes):
        want = run_reference(recipe)
        got = results[0][i]
        assert_close_losses(got.losses, want.losses, LOSS_RTOL)
        diff = max_weight_diff(got.state, want.state)
        assert diff < WEIGHT_ATOL, (cases[i], diff)
        for other in results[1:]:  # every rank holds the same consolidated weights
            assert max_weight_diff(other[i].state, got.state) == 0.0


def test_params_larger_than_a_chunk_match_pytorch():
    recipe = Recipe(model="llama", ac=False)
    probe = er.prepare(*build(recipe), config=er.ElixirConfig(mode="static", chunk_size=OVERSIZE_CHUNK))[0]
    layout = probe._elixir.runtime.layout
    own = [c for c in layout.chunks if c.private]
    assert [layout.names[s.param][0] for c in own for s in c.slots] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert [c.numel for c in own] == [4096, 4096] and layout.block_numel <= OVERSIZE_CHUNK
    want = run_reference(recipe)
    for n_blocks, offload in PLAN_SHAPES:
        got = run_elixir(recipe, n_blocks=n_blocks or "mid", offload=offload, chunk_size=OVERSIZE_CHUNK)
        assert_close_losses(got.losses, want.losses, LOSS_RTOL)
        diff = max_weight_diff(got.state, want.state)
        assert diff < WEIGHT_ATOL, (n_blocks, offload, diff)


def test_ranks_built_on_meta_start_from_rank_0_weights():
    """Rank 1 builds the model on meta (the host holds it once): prepare broadcasts rank 0's
    parameters and buffers (Llama's rotary ``inv_freq``), and training matches PyTorch."""
    cases = [
        (Recipe(model=m, world_size=2, meta_ranks=True, steps=MULTI_RANK_STEPS), s)
        for m, s in zip(["gpt2", "llama"], PLAN_SHAPES)
    ]
    recipes = [r for r, _ in cases]
    results = run_distributed(_rank_runs, 2, recipes, [s for _, s in cases])
    for i, recipe in enumerate(recipes):
        want = run_reference(recipe)
        assert_close_losses(results[0][i].losses, want.losses, LOSS_RTOL)
        assert max_weight_diff(results[0][i].state, want.state) < WEIGHT_ATOL, cases[i]
        assert max_weight_diff(results[1][i].state, results[0][i].state) == 0.0


def test_no_sync_accumulation_matches_pytorch():
    """GA written the DDP way (no_sync on all but the last micro-step) gives the same numbers."""
    recipe = Recipe(grad_accum=3, steps=5)
    want = run_reference(recipe)
    model, opt = build(recipe)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static", n_blocks="min", offload=0.5))
    losses = []
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        for micro in range(recipe.grad_accum):
            ctx = opt.no_sync() if micro < recipe.grad_accum - 1 else torch.enable_grad()
            with ctx:
                loss = model(**batch_for(recipe, step, micro, 0)).loss / recipe.grad_accum
                opt.backward(loss)
            losses.append(loss.item())
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    assert_close_losses(losses, want.losses, LOSS_RTOL)
    assert max_weight_diff(model.state_dict(), want.state) < WEIGHT_ATOL
