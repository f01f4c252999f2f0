"""The chunk state machines (``runtime/state.py``): the tables, their checks, and training runs that
walk only the transitions the tables list."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.runtime import state
from elixir_runtime.runtime.state import (
    GRAD_TRANSITIONS,
    PARAM_TRANSITIONS,
    ChunkState,
    GradState,
    IllegalTransition,
    ParamState,
)
from helpers.dist import run_distributed
from helpers.models import make_batch, make_mlp_batch, tiny_gpt2, tiny_mlp


@pytest.fixture
def checking():
    old = state.check_transitions(True)
    yield
    state.check_transitions(old)


@pytest.fixture
def walked(checking, monkeypatch) -> set[tuple]:
    """The (old, new) transitions chunks take while the test runs; each is still checked."""
    seen: set[tuple] = set()
    check = state._check

    def record(c, old, new):
        check(c, old, new)
        seen.add((old, new))

    monkeypatch.setattr(state, "_check", record)
    return seen


def _chunk(params: ParamState = ParamState.RELEASED, grads: GradState = GradState.EMPTY) -> ChunkState:
    c = ChunkState(spec=SimpleNamespace(index=7), shards=None, offset=0, shard_numel=0, name="h.3.mlp.c_fc.weight")
    c.param_state, c.grad_state = params, grads  # set up, not a transition
    return c


def _setup_for(new) -> dict:
    """The other machine's state that the cross rules ask for on entering ``new``."""
    if new in (GradState.WRITING, GradState.ACCUMULATING):
        return {"params": ParamState.GATHERED}
    return {}


def test_tables_cover_every_state_and_reach_them_all():
    for enum, table, start in (
        (ParamState, PARAM_TRANSITIONS, ParamState.RELEASED),
        (GradState, GRAD_TRANSITIONS, GradState.EMPTY),
    ):
        assert set(table) == set(enum)
        reached, todo = {start}, [start]
        while todo:
            for nxt in table[todo.pop()] - reached:
                reached.add(nxt)
                todo.append(nxt)
        assert reached == set(enum)
        assert all(s not in table[s] for s in enum)  # no self-transitions: a transition is a change


@pytest.mark.parametrize("table", [PARAM_TRANSITIONS, GRAD_TRANSITIONS], ids=["params", "grads"])
def test_every_legal_transition_is_accepted(checking, table):
    for old, news in table.items():
        for new in news:
            c = _chunk(**{("params" if type(old) is ParamState else "grads"): old}, **_setup_for(new))
            c.transition(new)
            assert (c.param_state if type(new) is ParamState else c.grad_state) is new


@pytest.mark.parametrize("table", [PARAM_TRANSITIONS, GRAD_TRANSITIONS], ids=["params", "grads"])
def test_every_illegal_transition_raises_naming_both_states_and_the_chunk(checking, table):
    kind = "params" if table is PARAM_TRANSITIONS else "grads"
    for old in table:
        for new in set(table) - table[old] - {old}:
            c = _chunk(**{kind: old}, **_setup_for(new))
            with pytest.raises(IllegalTransition) as e:
                c.transition(new)
            msg = str(e.value)
            assert f"{old.name} -> {new.name}" in msg and "chunk 7" in msg and "h.3.mlp.c_fc.weight" in msg, msg
            assert (c.param_state if kind == "params" else c.grad_state) is old  # unchanged


def test_the_cross_rules(checking):
    with pytest.raises(IllegalTransition, match=r"EMPTY -> WRITING while its params are GATHERING, not GATHERED"):
        _chunk(ParamState.GATHERING).transition(GradState.WRITING)
    with pytest.raises(IllegalTransition, match=r"GATHERED -> RELEASED while its gradients are ACCUMULATING"):
        _chunk(ParamState.GATHERED, GradState.ACCUMULATING).transition(ParamState.RELEASED)


def test_unchecked_transitions_are_plain_writes():
    old = state.check_transitions(False)
    try:
        c = _chunk()
        c.transition(GradState.ACCUMULATING)  # illegal, not checked
        assert c.grad_state is GradState.ACCUMULATING
    finally:
        state.check_transitions(old)


def _step(model, opt, batches, clip=True):
    with opt.no_sync():
        for b in batches[:-1]:
            opt.backward(model(**b).loss)
    opt.backward(model(**batches[-1]).loss)
    if clip:
        opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()


def _assert_between_steps(rt) -> None:
    for c in rt.chunks:
        assert c.grad_state is GradState.EMPTY and c.pins == 0 and not c.written, c
        assert c.param_state is not ParamState.COPIED, c


@pytest.mark.parametrize(
    "cfg",
    [
        {"n_blocks": "min", "offload": 0.5, "prefetch": 2},
        {"n_blocks": "max", "offload": 0.0, "prefetch": 0},
        {"n_blocks": "min", "offload": 1.0, "prefetch": 2, "device_assisted_update": True},
    ],
    ids=["min-offload-prefetch", "max", "offload-all-lane"],
)
def test_training_walks_only_legal_transitions(walked, cfg):
    """Gradient accumulation under no_sync, clipping, an eval forward, full_params and activation
    checkpointing, with every transition checked; the walk covers the tables' main paths."""
    model = tiny_gpt2(n_layer=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static", **cfg), example_batch=make_batch(128))
    rt = model._elixir.runtime
    batches = [make_batch(128, seed=s) for s in range(2)]
    for _ in range(3):
        _step(model, opt, batches)
        _assert_between_steps(rt)
    model.eval()
    with torch.no_grad():
        model(**batches[0])
    with er.full_params(model):
        model(**batches[0])
    model.train()
    _assert_between_steps(rt)
    _step(model, opt, batches[:1], clip=False)
    _assert_between_steps(rt)
    P, G = ParamState, GradState
    expected = {
        (P.RELEASED, P.GATHERING),
        (P.GATHERING, P.GATHERED),
        (P.GATHERED, P.RELEASED),
        (G.EMPTY, G.WRITING),
        (G.WRITING, G.REDUCED),
        (G.REDUCED, G.HELD),
        (G.HELD, G.ACCUMULATING),
        (G.ACCUMULATING, G.REDUCED),
        (G.HELD, G.EMPTY),
    }
    if cfg["n_blocks"] == "min":  # rCache max keeps every chunk gathered: nothing left to copy
        expected |= {(P.RELEASED, P.COPIED), (P.COPIED, P.RELEASED)}
    assert expected <= walked, expected - walked


def test_unused_and_frozen_parameters_walk_only_legal_transitions(walked):
    """One rank: a chunk without any gradient gets a zeroed shard at the end of backward (EMPTY -> HELD)."""
    model = tiny_mlp(unused_branch=True, freeze_first=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = er.prepare(
        model,
        opt,
        er.ElixirConfig(mode="static", n_blocks="min", offload=0.5),
        example_batch=make_mlp_batch(),
    )
    for s in range(2):
        _step(model, opt, [make_mlp_batch(seed=s)])
        _assert_between_steps(model._elixir.runtime)
    assert (GradState.EMPTY, GradState.HELD) in walked


def test_zero_grad_inside_a_backward_is_caught(checking):
    """A misuse the table rules out: zero_grad while chunks are reduced in a running backward."""
    model = tiny_gpt2(n_layer=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static", n_blocks="min"), example_batch=make_batch(128))
    hidden = []
    model.transformer.h[0].register_forward_hook(
        lambda _m, _a, out: hidden.append(out[0] if isinstance(out, tuple) else out)
    )
    loss = model(**make_batch(128)).loss
    hidden[0].register_hook(lambda g: opt.zero_grad())  # blocks 1 and 2 are reduced by then
    with pytest.raises(IllegalTransition, match=r"GradState transition REDUCED -> EMPTY"):
        opt.backward(loss)


def _walk_on_ranks(rank: int, world_size: int) -> set[tuple[str, str]]:
    state.check_transitions(True)
    seen: set[tuple[str, str]] = set()
    check = state._check
    state._check = lambda c, old, new: (check(c, old, new), seen.add((old.name, new.name)))
    model = tiny_mlp(unused_branch=True)
    model, opt = er.prepare(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        er.ElixirConfig(mode="static", n_blocks="min", offload=0.5),
        example_batch=make_mlp_batch(),
    )
    for s in range(2):
        _step(model, opt, [make_mlp_batch(seed=10 * s + m + 100 * rank) for m in range(2)])
        _assert_between_steps(model._elixir.runtime)
    return seen


def test_several_ranks_walk_only_legal_transitions():
    """Two ranks: a chunk no rank has a gradient for is reduced with zeros (EMPTY -> REDUCED), and
    added to in the next micro-step (HELD -> REDUCED), so the ranks' collectives match."""
    for seen in run_distributed(_walk_on_ranks, 2):
        assert {("EMPTY", "REDUCED"), ("HELD", "REDUCED"), ("HELD", "ACCUMULATING")} <= seen, seen
