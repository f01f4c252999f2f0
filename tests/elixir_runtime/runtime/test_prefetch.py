"""Prefetch follows the recorded trace, and never waits on a chunk whose CPU update is running."""

from __future__ import annotations

import elixir_runtime as er
from helpers.dist import run_distributed
from helpers.training import Recipe, batch_for, build


def _prepared(offload: float):
    recipe = Recipe(steps=3)
    model, opt = build(recipe)
    cfg = er.ElixirConfig(mode="static", n_blocks="min", offload=offload, prefetch=2)
    model, opt = er.prepare(model, opt, cfg, example_batch=batch_for(recipe, 0, 0, 0))
    return recipe, model, opt


def _train_step(recipe, model, opt, step: int) -> None:
    opt.backward(model(**batch_for(recipe, step, 0, 0)).loss)
    opt.step()
    opt.zero_grad()


def test_prefetch_starts_once_the_trace_is_recorded():
    recipe, model, opt = _prepared(offload=0.0)
    runtime = model._elixir.runtime
    _train_step(recipe, model, opt, 0)  # records the trace: nothing to prefetch from yet
    assert runtime.stats.prefetches == 0
    _train_step(recipe, model, opt, 1)
    assert runtime.stats.prefetches > 0


def test_prefetch_skips_chunks_still_being_updated(monkeypatch):
    recipe, model, opt = _prepared(offload=1.0)
    runtime = model._elixir.runtime
    for step in range(2):
        _train_step(recipe, model, opt, step)
    monkeypatch.setattr(runtime.host_updates, "busy", lambda chunk: True)
    before = runtime.stats.prefetches
    _train_step(recipe, model, opt, 2)
    assert runtime.stats.prefetches == before  # demand gathers only: no early wait
    monkeypatch.undo()
    runtime.host_updates.wait_all()  # every update landed: nothing is busy, however fast the CPU thread ran
    _train_step(recipe, model, opt, 3)
    assert runtime.stats.prefetches > before


def _ranks_with_different_worker_speeds(rank: int, world_size: int) -> list[float]:
    recipe, model, opt = _prepared(offload=1.0)
    losses = []
    for step in range(4):
        if step == 2 and rank == 0:  # rank 0's CPU updates now look slow, rank 1's fast
            model._elixir.runtime.host_updates.busy = lambda chunk: True
        loss = model(**batch_for(recipe, step, 0, 0)).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_prefetch_decisions_agree_across_ranks():
    """A prefetch is a collective: whether it happens must not depend on how fast each rank's CPU
    updates run. Here one rank's updates look permanently slow; the ranks must still train in
    lockstep to identical losses."""
    results = run_distributed(_ranks_with_different_worker_speeds, 2, timeout=120)
    assert results[0] == results[1]
