"""An out-of-memory error in a planned run keeps its type and message (what batch-size retries test for) and
gains a note telling it against the plan: the predicted peak and its parts, and the ways out
(``elixir_runtime/runtime/oom.py``); in the forward (the root's hook) and in the backward (the optimizer's)."""

from __future__ import annotations

import pytest
import torch

import elixir_runtime as er
from helpers.models import make_batch, tiny_llama


class _OutOfMemory(torch.autograd.Function):
    """Identity whose forward or backward raises CUDA's out-of-memory error, as the allocator would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: str) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        ctx.where = where
        if where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[no-untyped-def, override]
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_error_is_told_against_the_plan(where: str) -> None:
    model = tiny_llama(n_layer=2)
    model.model.norm.register_forward_hook(lambda _m, _a, out: _OutOfMemory.apply(out, where))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(128, device=torch.device("cpu"))
    config = er.ElixirConfig(mode="static", device="cpu")
    model, opt = er.prepare(model, opt, config=config, example_batch=batch)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as caught:
        opt.backward(model(**batch).loss)
    (note,) = caught.value.__notes__
    assert f"out of GPU memory in the {where}" in note
    assert "model states and cache" in note and "activations not profiled (a static plan)" in note
    assert '"activations": "host"' in note and '"gpu_memory"' in note and '"moments": "8bit"' in note


def test_a_profiled_plan_names_its_peak_and_parts() -> None:
    from elixir_runtime.runtime.oom import PlannedMemory

    gib = 2**30
    note = PlannedMemory(10 * gib, 20 * gib, (1, 262144), "host").note("backward", torch.device("cpu"))
    assert "a peak of 30.00 GiB: 10.00 of model states and cache + 20.00 of activations of a 1 x 262144 batch" in note
    assert "(held block inputs on the host)" in note and '"activations": "host"' not in note  # already there
