"""``moments="8bit"``: fp32 master weights with block-wise 8-bit Adam moments, end to end.

It follows exact AdamW's losses within a stated tolerance on every placement; its state by name is
layout-free, so a save -> load -> continue on another layout or rank count equals the uninterrupted
run bit for bit; a state of the other kind of moments loads converted, and logged.
"""

from __future__ import annotations

import logging

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.adam_state import QUANT_BLOCK
from elixir_runtime.config import ConfigError
from elixir_runtime.kernels import quant8
from helpers.models import make_batch, tiny_gpt2

LAYOUTS = {
    "half-offloaded": dict(n_blocks="min", offload=0.5),
    "on-device": dict(n_blocks="max", offload=0.0),
    "offloaded-big-chunks": dict(n_blocks="min", offload=1.0, chunk_size=16384),
}
STEPS = 8
LOSS_RTOL = 2e-3
"""8-bit moments against exact over ``STEPS`` steps at lr 1e-3: the moments' relative error (about
1 % per element, unbiased) moves the loss by far less than a step does."""


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def _prepare(model: torch.nn.Module, moments: str, **layout):
    config = er.ElixirConfig(mode="static", moments=moments, **layout)
    return er.prepare(model, _adamw(model), config=config, example_batch=make_batch(model.config.vocab_size))


def _train(model, opt, steps: range) -> list[float]:
    losses = []
    for s in steps:
        loss = model(**make_batch(model.config.vocab_size, seed=s % 2)).loss  # two batches: the loss falls
        opt.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", LAYOUTS)
def test_follows_exact_adamw(layout: str) -> None:
    torch.manual_seed(0)
    exact = _train(*_prepare(tiny_gpt2(), "fp32", **LAYOUTS[layout]), range(STEPS))
    torch.manual_seed(0)
    model, opt = _prepare(tiny_gpt2(), "8bit", **LAYOUTS[layout])
    compact = _train(model, opt, range(STEPS))
    assert model._elixir.plan.moments == "8bit" and exact[-1] < exact[0]
    torch.testing.assert_close(torch.tensor(compact), torch.tensor(exact), rtol=LOSS_RTOL, atol=0)
    # the arenas hold codes and a scale per block; every parameter starts a block
    rt = model._elixir.runtime
    for a in rt.arenas.values():
        assert (
            a.state["exp_avg"].dtype == torch.uint8
            and a.state["exp_avg.absmax"].numel() == a.trainable_numel // QUANT_BLOCK
        )
    assert all(s.offset % QUANT_BLOCK == 0 for c in rt.layout.chunks for s in c.slots)


@pytest.mark.parametrize("layout", ["half-offloaded", "offloaded-big-chunks"])
def test_state_loads_bitwise_into_any_layout(layout: str) -> None:
    """Save at step 4 of a half-offloaded run and load it into a run of ``layout``: it holds the saved
    codes and scales bit for bit; on the same layout the continued run is the uninterrupted one, bit
    for bit (on another, the gradient norm's sum runs in another order)."""
    torch.manual_seed(0)
    model, opt = _prepare(tiny_gpt2(), "8bit", **LAYOUTS["half-offloaded"])
    _train(model, opt, range(4))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    rest = _train(model, opt, range(4, STEPS))

    torch.manual_seed(0)
    other, other_opt = _prepare(tiny_gpt2(), "8bit", **LAYOUTS[layout])
    other.load_state_dict(weights)
    other_opt.load_state_dict(saved)
    mine, theirs = saved["tensors"], other_opt.state_dict()["tensors"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {k.rsplit(".", 1)[-1] for k in mine} >= {"exp_avg", "exp_avg_sq", "absmax", "master"}
    again = _train(other, other_opt, range(4, STEPS))
    if layout == "half-offloaded":
        assert again == rest
    else:
        torch.testing.assert_close(torch.tensor(again), torch.tensor(rest), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("saved", "loaded"), [("8bit", "fp32"), ("fp32", "8bit")])
def test_other_moments_load_converted_and_logged(saved: str, loaded: str, caplog) -> None:
    torch.manual_seed(0)
    model, opt = _prepare(tiny_gpt2(), saved, **LAYOUTS["half-offloaded"])
    _train(model, opt, range(3))
    state, weights = opt.state_dict(), model.state_dict()
    torch.manual_seed(0)
    other, other_opt = _prepare(tiny_gpt2(), loaded, **LAYOUTS["half-offloaded"])
    other.load_state_dict(weights)
    with caplog.at_level(logging.WARNING, logger="elixir_runtime"):
        other_opt.load_state_dict(state)
    assert f"holds {saved} moments and this run keeps {loaded}" in caplog.text
    got = other_opt.state_dict()["tensors"]
    for name in {k.rsplit(".", 1)[0] for k in state["tensors"] if k.endswith(".master")}:
        assert torch.equal(got[f"{name}.master"], state["tensors"][f"{name}.master"])
        for kind in quant8.MOMENT_KINDS:
            if saved == "8bit":  # dequantized exactly
                want = quant8.dequantize(
                    kind, state["tensors"][f"{name}.{kind}"], state["tensors"][f"{name}.{kind}.absmax"]
                )
                assert torch.equal(got[f"{name}.{kind}"], want)
            else:  # quantized: what quantize gives
                codes, scales = quant8.quantize(kind, state["tensors"][f"{name}.{kind}"])
                assert torch.equal(got[f"{name}.{kind}"], codes) and torch.equal(got[f"{name}.{kind}.absmax"], scales)
    assert other_opt.step_count == opt.step_count


def test_unknown_moments_are_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"moments.*'fp32'.*'8bit'"):
        er.ElixirConfig(moments="4bit")
