"""``prepare(..., resident=...)``: a parameter the model's forward reads without calling the module
that holds it (TRL's fused LM head multiplies by ``lm_head.weight`` itself) gets a private chunk that
the root's forward gathers. Without it the read sees the zero placeholder (uniform logits, the head
never trains, no error); with it training matches plain PyTorch at 1 and 2 ranks, with the small
rCache and offloading, and with gradient accumulation."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import elixir_runtime as er
from elixir_runtime.runtime.state import check_transitions
from helpers.dist import run_distributed
from helpers.training import (
    VOCAB,
    Recipe,
    assert_close_losses,
    batch_for,
    build,
    lr_at,
    max_weight_diff,
)

STEPS = 4
GRAD_ACCUM = 2


def _head_outside(self, input_ids, labels, **_):
    """The backbone, then the head's weight read directly (as ``add_fused_lm_head`` does)."""
    hidden = self.model(input_ids=input_ids).last_hidden_state
    logits = hidden[:, :-1] @ self.get_output_embeddings().weight.t()
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


def _run(rank: int | None, world_size: int, resident: bool, offload: float = 0.5) -> tuple[list[float], dict]:
    """``rank=None``: plain PyTorch on the global batch; else Elixir on this rank's slice."""
    recipe = Recipe(model="llama", world_size=world_size, grad_accum=GRAD_ACCUM, steps=STEPS)
    model, opt = build(recipe)
    model.forward = types.MethodType(_head_outside, model)
    head = model.lm_head.weight
    if rank is not None:
        config = er.ElixirConfig(mode="static", n_blocks="min", offload=offload)
        model, opt = er.prepare(model, opt, config, batch_for(recipe, 0, 0, rank), resident=[head] if resident else [])
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


def test_without_resident_the_read_is_wrong_and_caught_in_debug_runs() -> None:
    """What ``resident`` fixes: silently, a zero head (loss ln(vocab)); with the state checks on
    (``ELIXIR_DEBUG_STATES=1``), the head's gradient without a call of its module is an error."""
    old = check_transitions(False)
    try:
        losses, _ = _run(0, 1, resident=False)
        assert math.isclose(losses[0] * GRAD_ACCUM, math.log(VOCAB), rel_tol=1e-6)
        check_transitions(True)
        with pytest.raises(RuntimeError, match=r"'lm_head.weight' got a gradient, but no module holding it ran"):
            _run(0, 1, resident=False)
    finally:
        check_transitions(old)


def test_the_resident_chunk_is_private_and_counted() -> None:
    recipe = Recipe(model="llama")
    model, opt = build(recipe)
    model, _ = er.prepare(model, opt, er.ElixirConfig(mode="static"), resident=[model.lm_head.weight])
    plan = model._elixir.plan
    i = plan.param_table.index[id(model.lm_head.weight)]
    (chunk,) = plan.root_chunks
    assert plan.layout.param_chunk[i] == chunk and plan.layout.chunks[chunk].private
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
    model.forward = types.MethodType(_head_outside, model)
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
