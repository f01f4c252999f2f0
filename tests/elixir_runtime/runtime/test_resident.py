"""A parameter the model's forward reads without calling the module that holds it (TRL's fused LM
head and Liger's fused linear cross entropy multiply by ``lm_head.weight`` themselves) gets a private
chunk that the root's forward gathers: named in ``prepare(..., resident=...)``, or found by the trace
of the example batch (``profiler/outside.py``). Training then matches plain PyTorch at 1 and 2 ranks,
with the small rCache and offloading, and with gradient accumulation. A read neither saw fails in
the first forward, before any step ([Note: placeholder reads])."""

from __future__ import annotations

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.runtime import hooks
from elixir_runtime.runtime import state as engine_state
from elixir_runtime.runtime.hooks import PlaceholderReadError
from helpers.dist import run_distributed
from helpers.models import read_head_outside
from helpers.training import (
    Recipe,
    assert_close_losses,
    batch_for,
    build,
    lr_at,
    max_weight_diff,
)

STEPS = 4
GRAD_ACCUM = 2


def _run(
    rank: int | None, world_size: int, resident: bool, offload: float = 0.5, traced: bool = True
) -> tuple[list[float], dict]:
    """``rank=None``: plain PyTorch on the global batch; else Elixir on this rank's slice (``traced``:
    prepared with an example batch)."""
    recipe = Recipe(model="llama", world_size=world_size, grad_accum=GRAD_ACCUM, steps=STEPS)
    model, opt = build(recipe, on_device=rank is None)
    head = read_head_outside(model)
    if rank is not None:
        config = er.ElixirConfig(mode="static", n_blocks="min", offload=offload)
        example = batch_for(recipe, 0, 0, rank) if traced else None
        model, opt = er.prepare(model, opt, config, example, resident=[head] if resident else [])
    losses = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        for micro in range(GRAD_ACCUM):
            batch = batch_for(recipe, step, micro, rank)
            loss = model(**batch) / GRAD_ACCUM
            if rank is None:
                loss.backward()
            else:
                opt.backward(loss)
            losses.append(loss.item())
        if rank is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, world_size: int) -> tuple[list[float], dict]:
    return _run(rank, world_size, resident=True)


def test_a_head_read_outside_its_module_trains_as_pytorch() -> None:
    want_losses, want = _run(None, 1, resident=False)
    for offload in (0.0, 1.0):
        losses, state = _run(0, 1, resident=True, offload=offload)
        assert_close_losses(losses, want_losses, 1e-6)
        assert max_weight_diff(state, want) < 1e-5, offload


def test_the_trace_finds_the_read_without_being_told() -> None:
    want_losses, want = _run(None, 1, resident=False)
    losses, state = _run(0, 1, resident=False)
    assert_close_losses(losses, want_losses, 1e-6)
    assert max_weight_diff(state, want) < 1e-5


def test_a_read_nothing_saw_fails_in_the_first_forward() -> None:
    """No example batch, so no trace: the first forward reads the head's placeholder and raises,
    naming it, before any step; without the check that forward would see a zero head (loss
    ln(vocab)) and train on."""
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    read_head_outside(model)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlaceholderReadError, match=r"read 'lm_head.weight' .* outside its module's call"):
        model(**batch_for(recipe, 0, 0, 0))
    assert max_weight_diff(model.state_dict(), before) == 0


def test_only_the_first_forward_of_each_kind_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check costs a Python call per op: the first training and the first no-grad forward run
    under it, later ones do not (each one while the state checks are on, as in this suite)."""
    monkeypatch.setattr(engine_state, "CHECKING", False)
    watched: list[bool] = []
    real = hooks._PlaceholderReads.__enter__
    monkeypatch.setattr(
        hooks._PlaceholderReads, "__enter__", lambda self: (watched.append(torch.is_grad_enabled()), real(self))[1]
    )
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static"), batch_for(recipe, 0, 0, 0))
    for grad in (True, True, False, False, True):
        with torch.set_grad_enabled(grad):
            model(**batch_for(recipe, 0, 0, 0))
    assert watched == [True, False]


def test_the_resident_chunk_is_private_and_counted() -> None:
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    model, _ = er.prepare(model, opt, er.ElixirConfig(mode="static"), resident=[model.lm_head.weight])
    plan, live = model._elixir.plan, model._elixir.live
    i = live.param_table.index[id(model.lm_head.weight)]
    (chunk,) = live.root_chunks
    assert live.layout.param_chunk[i] == chunk and live.layout.chunks[chunk].private
    assert plan.memory.private == model.lm_head.weight.numel() * 4  # fp32, its own buffer
    with pytest.raises(ValueError, match="not parameters of this model"):
        other, opt2 = build(recipe)
        er.prepare(other, opt2, er.ElixirConfig(mode="static"), resident=[torch.nn.Parameter(torch.zeros(2))])


def test_two_ranks_match_pytorch() -> None:
    """Each rank gathers the head at the same point of every forward; the averaged gradients and so
    the weights are plain PyTorch's on the global batch (the losses are each rank's own slice's)."""
    _, want = _run(None, 2, resident=False)
    for _, state in run_distributed(_rank, 2):
        assert max_weight_diff(state, want) < 1e-5


def test_the_chunk_the_root_needs_first_is_updated_first() -> None:
    """The root's pre-forward gathers the head's chunk before any unit runs, so the next forward's
    first wait is for that chunk's update: the CPU lane takes it first, then chunk order."""
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    read_head_outside(model)
    config = er.ElixirConfig(mode="static", offload=1.0)
    model, opt = er.prepare(model, opt, config, batch_for(recipe, 0, 0, 0), resident=[model.lm_head.weight])
    runtime = model._elixir.runtime
    (head,) = runtime.root_chunks
    order = [c.index for c in runtime.update_order]
    assert order[0] == head and order[1:] == sorted(order[1:]) and head > order[-1]
    runtime.host_updates.trace = []
    opt.backward(model(**batch_for(recipe, 0, 0, 0)))
    opt.step()
    runtime.host_updates.wait_all()
    cpu = [chunk for lane, chunk, *_ in runtime.host_updates.trace if lane == "cpu"]
    assert cpu[0] == head and list(dict.fromkeys(cpu)) == order
