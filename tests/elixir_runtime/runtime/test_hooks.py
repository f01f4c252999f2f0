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
    model, opt = er.prepare(model, opt, er.ElixirConfig(mode="static", offload=offload, device="cpu"),
                            example_batch=make_batch(128))
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
