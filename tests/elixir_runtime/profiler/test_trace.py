"""``trace_unit_order`` (a forward in ``fake.fake_run``, as the profiler's step) against the order in
which a real forward first calls each unit; registration order when the model cannot run on fakes."""

from __future__ import annotations

import logging
from collections import UserDict
from collections.abc import Mapping

import pytest
import torch
from torch import nn

from elixir_runtime.profiler.trace import trace_unit_order
from elixir_runtime.units import Unit, find_units
from helpers.logs import captured
from helpers.models import make_batch, tiny_gpt2, tiny_llama

CPU = torch.device("cpu")
FALLBACK = "fake-tensor trace failed"


class TiedReversed(nn.Module):
    """Registers its modules in reverse of use order; the head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16, bias=False)
        self.late = nn.Linear(8, 8)
        self.early = nn.Linear(8, 8)
        self.embed = nn.Embedding(16, 8)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        return self.head(self.late(self.early(self.embed(input_ids))))


class DataDependent(nn.Module):
    """Branches on a value: fake tensors have none, so the trace falls back to registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(4, 4)
        self.early = nn.Linear(4, 4)

    def forward(self, x):
        x = self.early(x)
        if x.sum() > 0:
            x = x.relu()
        return self.late(x)


def _real_order(model: nn.Module, units: list[Unit], batch) -> list[int]:
    """Unit indices in the order a real training-mode forward first calls them."""
    calls: list[int] = []
    handles = [u.module.register_forward_pre_hook(lambda _m, _a, i=u.index: calls.append(i)) for u in units]
    model.train()
    try:
        with torch.no_grad():
            model(**batch) if isinstance(batch, Mapping) else model(batch)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(calls))


@pytest.mark.parametrize(
    ("build", "batch", "dtype"),
    [
        (tiny_gpt2, make_batch(128), torch.float32),
        (tiny_llama, make_batch(128), torch.float32),
        (tiny_llama, make_batch(128), torch.bfloat16),
        (TiedReversed, {"input_ids": torch.randint(0, 16, (2, 5))}, torch.float32),
        # a mapping that is not a dict: what transformers' padding collators return (BatchEncoding)
        (tiny_llama, UserDict(make_batch(128)), torch.float32),
    ],
    ids=["gpt2-tied", "llama", "llama-bf16", "tied-registered-in-reverse", "llama-mapping-batch"],
)
def test_order_is_the_real_forwards_first_calls(build, batch, dtype, caplog) -> None:
    model = build()
    units = find_units(model, None)
    with captured(caplog, logging.INFO, "elixir_runtime.profiler.trace"):
        order, outside = trace_unit_order(model, units, batch, dtype, CPU)
    assert FALLBACK not in caplog.text  # traced, not the fallback
    real = _real_order(model, units, batch)
    assert sorted(real) == [u.index for u in units]  # every unit runs in these models
    assert order == real
    assert outside == []  # each parameter is read inside a call of a unit holding it (tied ones too)
    assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())  # the real weights are back


def test_the_reversed_model_needs_the_trace() -> None:
    """Registration order is wrong for ``TiedReversed``: the test above could fail."""
    model = TiedReversed()
    units = find_units(model, None)
    assert [u.index for u in units] != _real_order(model, units, {"input_ids": torch.randint(0, 16, (2, 5))})


def test_data_dependent_branch_falls_back_to_registration_order(caplog) -> None:
    model = DataDependent()
    units = find_units(model, None)
    with captured(caplog, logging.INFO, "elixir_runtime.profiler.trace"):
        order, outside = trace_unit_order(model, units, torch.randn(2, 4), torch.float32, CPU)
    assert FALLBACK in caplog.text
    assert order == [u.index for u in units] and outside == []
    assert [units[i].name for i in order] == ["late", "early"]  # registration order, not the use order
