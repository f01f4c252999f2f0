"""Self-tests for the tiny models of the runtime tests (helpers/models.py)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.models import MODEL_BUILDERS, make_batch, make_mlp_batch, tiny_mlp


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
