"""The engine's hooks hold it only weakly: dropping the model and optimizer frees it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import elixir_runtime as er
from helpers.models import make_batch, tiny_gpt2


def _trained_runtime(offload: float) -> weakref.ref:
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static", offload=offload), example_batch=make_batch(128))
    loss = model(**make_batch(128)).loss
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    opt.runtime.host_updates.wait_all()  # a running CPU update holds the optimizer until it is done
    return weakref.ref(model._elixir.runtime)


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_engine_is_freed_with_the_model_and_optimizer(offload: float) -> None:
    """A grad hook lives in the tensor's C++ autograd meta, where the garbage collector cannot see
    a cycle through it: one holding the runtime kept every arena (GPU memory, pinned host memory)
    of a dropped engine, so a second ``prepare`` in the process found the GPU half full."""
    runtime = _trained_runtime(offload)
    gc.collect()
    assert runtime() is None


def test_accumulating_under_a_one_micro_batch_plan_warns_once() -> None:
    """A plan that let the GPU's gradient shards use the loss's activation memory warns when a
    forward starts with them still held (accumulation); after zero_grad they are freed: no warning."""
    import warnings

    model = tiny_gpt2()
    config = er.ElixirConfig(mode="static", n_blocks="min")
    model, opt = er.prepare(model, torch.optim.AdamW(model.parameters()), config=config, example_batch=make_batch(128))
    rt = model._elixir.runtime
    rt.grads.warn_accumulation = True  # as a searched one-micro-batch plan with a gradient window sets it
    batch = make_batch(128)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(2):  # step + zero_grad between backwards: the shards are freed
            opt.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
            assert all(c.grad is None for c in rt.trainable if c.shards.placement == "device")
    with pytest.warns(RuntimeWarning, match="grad_accum_steps"):
        for _ in range(3):  # accumulation without zero_grad
            opt.backward(model(**batch).loss)
    assert not rt.grads.warn_accumulation  # once
