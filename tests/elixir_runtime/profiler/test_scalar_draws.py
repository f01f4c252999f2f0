"""Models that branch on a random scalar (LayerDrop) still trace on fake tensors."""

from __future__ import annotations

import torch
from torch import nn

from elixir_runtime.profiler.trace import trace_unit_order
from elixir_runtime.units import find_units


class LayerDropNet(nn.Module):
    """Registers its layers in reverse of use order and skips them with probability 0 (OPT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(4, 4)
        self.early = nn.Linear(4, 4)
        self.layerdrop = 0.0

    def forward(self, x):
        for layer in (self.early, self.late):
            if torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x


def test_layerdrop_traces_in_use_order_and_restores_torch_rand():
    original = torch.rand
    model = LayerDropNet()
    units = find_units(model, None)
    order = trace_unit_order(model, units, torch.randn(2, 4), torch.float32, torch.device("cpu")).order
    names = [units[i].name for i in order]
    assert [u.name for u in units] == ["late", "early"]  # registration order: what the fallback returns
    assert names == ["early", "late"]  # traced
    assert torch.rand is original
