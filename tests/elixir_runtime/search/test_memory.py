"""``search/memory.py``: the GPU's gradient shards counted against the activations freed after the
loss and head (``GradWindow``), as the engine allocates them (per chunk, backward to zero_grad)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from elixir_runtime.chunk.layout import build_layout
from elixir_runtime.search.memory import ArenaBytes, GradWindow, grad_window

BF16 = torch.bfloat16


def test_grad_window_only_for_one_micro_batch_and_a_known_late_peak() -> None:
    assert grad_window(100, 20, ["h"], 0.95, 1.25, 1) == GradWindow(int(0.95 * 1.25 * 80), ("h",))
    assert grad_window(100, 20, ["h"], 0.95, 1.25, 2) == GradWindow()  # accumulation: grads meet the next peak
    assert grad_window(100, None, [], 0.95, 1.25, 1) == GradWindow()  # no head found: nothing known freed
    assert grad_window(100, 120, [], 1.0, 1.0, 1).slack == 0


@pytest.mark.parametrize("slack", [0, 300, 10_000])
def test_device_grads_beyond_the_slack_or_the_heads(slack: int) -> None:
    sizes = [128, 128, 128, 128]  # one chunk each; the last is the head
    params = [nn.Parameter(torch.empty(n)) for n in sizes]
    names = [["a"], ["b"], ["c"], ["head.weight"]]
    layout = build_layout(params, names, [0] * 4, [False] * 4, world_size=1, chunk_size=128, alignment=8)
    mem = ArenaBytes(layout, BF16, window=GradWindow(slack, ("head.weight",)))
    every = ArenaBytes(layout, BF16)
    grad = 128 * 2
    for on_device in (np.array([True] * 4), np.array([True, True, True, False]), np.array([False, False, False, True])):
        g_all = grad * int(on_device.sum())
        g_head = grad * int(on_device[3])
        assert every.grads(on_device) == g_all
        assert mem.grads(on_device) == max(g_head, g_all - slack)
        assert mem.device(2, on_device) - every.device(2, on_device) == mem.grads(on_device) - g_all


def test_the_search_uses_the_window_only_where_gradients_share_activations() -> None:
    """Without expandable segments (``SearchSettings.grads_share_activations``) or with gradient
    accumulation, every gradient shard of the GPU counts beside the activations."""
    import dataclasses

    from elixir_runtime.config import ElixirConfig
    from elixir_runtime.search import Budget, SearchSettings, search
    from search_cases import GIB, gpu_host, profiled

    _, table, profile = profiled("llama", n_layer=4, batch=4, seq=64, vocab=4096)
    assert profile.late_peak is not None and profile.late_peak < profile.activation_peak
    budget = Budget(capacity=GIB, activations=profile.activation_peak, buffers=0, host_capacity=64 * GIB)
    settings = SearchSettings(1, BF16, ElixirConfig(offload=0.5))
    shared = search(table, profile, gpu_host(), budget, settings).grad_window
    assert shared.slack > 0 and "lm_head.weight" in shared.head
    for other in (dataclasses.replace(settings, grads_share_activations=False),
                  SearchSettings(1, BF16, ElixirConfig(offload=0.5, grad_accum_steps=2))):
        assert search(table, profile, gpu_host(), budget, other).grad_window == GradWindow()
