"""The engine's phase (``runtime/phase.py``): its table, its check, and the phases a step walks."""

from __future__ import annotations

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.runtime import state
from elixir_runtime.runtime.phase import PHASE_TRANSITIONS, EnginePhase, Phase
from elixir_runtime.runtime.state import IllegalTransition
from helpers.models import make_batch, tiny_gpt2


@pytest.fixture
def checking():
    old = state.check_transitions(True)
    yield
    state.check_transitions(old)


def _prepared(**config):
    model = tiny_gpt2(n_layer=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = er.ElixirConfig(mode="static", n_blocks="min", **config)
    return er.prepare(model, opt, config, example_batch=make_batch(128))


def test_every_phase_is_reached_from_idle_and_returns_to_it():
    assert set(PHASE_TRANSITIONS) == set(Phase)
    assert PHASE_TRANSITIONS[Phase.IDLE] == set(Phase) - {Phase.IDLE}
    assert all(Phase.IDLE in PHASE_TRANSITIONS[p] for p in Phase if p is not Phase.IDLE)


def test_a_change_the_table_does_not_list_raises_when_checking(checking):
    phase = EnginePhase()
    phase.to(Phase.FORWARD)
    with pytest.raises(IllegalTransition, match=r"engine phase FORWARD -> FULL \(from FORWARD: IDLE\)"):
        phase.to(Phase.FULL)
    state.check_transitions(False)
    phase.to(Phase.FULL)  # unchecked: a write
    assert phase.now is Phase.FULL


def test_a_step_walks_forward_backward_and_full_params(checking):
    model, opt = _prepared()
    phase = model._elixir.runtime.ctx.phase
    seen = []

    def block_hook(_module, _args, out) -> None:
        seen.append(("block forward", phase.now))
        if torch.is_grad_enabled():
            (out[0] if isinstance(out, tuple) else out).register_hook(
                lambda g: seen.append(("block backward", phase.now))
            )

    model.transformer.h[1].register_forward_hook(block_hook)
    loss = model(**make_batch(128)).loss
    seen.append(("after forward", phase.now))
    opt.backward(loss)
    seen.append(("after backward", phase.now))
    opt.step()
    opt.zero_grad()
    with er.full_params(model):
        seen.append(("full_params", phase.now))
        model(**make_batch(128))
    seen.append(("after full_params", phase.now))
    assert seen == [
        ("block forward", Phase.FORWARD),
        ("after forward", Phase.IDLE),
        ("block backward", Phase.BACKWARD),
        ("after backward", Phase.IDLE),
        ("full_params", Phase.FULL),
        ("block forward", Phase.FULL),  # the hooks stand by
        ("after full_params", Phase.IDLE),
    ]


def test_full_params_is_refused_inside_a_forward():
    """Between two units of a forward no chunk is pinned: the phase still says it is a forward."""
    model, _ = _prepared()
    errors = []

    def enter(_module, _args):
        with pytest.raises(RuntimeError, match="cannot be entered during a forward or backward") as e:
            er.full_params(model).__enter__()
        errors.append(e.value)

    model.transformer.drop.register_forward_pre_hook(enter)  # no parameters: not a unit
    model(**make_batch(128))
    assert len(errors) == 1 and model._elixir.runtime.ctx.phase.now is Phase.IDLE
