"""``search/memory.py``: the GPU's gradient shards counted against the activations backward has
freed by the time they exist (``GradWindow``), as the engine allocates them (per chunk, backward to
zero_grad)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from elixir_runtime.adam_state import ADAM_STATE
from elixir_runtime.chunk.layout import build_layout
from elixir_runtime.profiler.profile import BackwardSegment
from elixir_runtime.search.memory import ArenaBytes, GradWindow, WindowStep, grad_window

BF16 = torch.bfloat16


def test_grad_window_only_for_one_micro_batch_and_a_known_backward() -> None:
    backward = [BackwardSegment(100, ["h"]), BackwardSegment(20, ["b1"]), BackwardSegment(10, ["b0", "e"])]
    window = grad_window(100, backward, 0.98, 1.25, 1)
    assert window == GradWindow(
        (
            WindowStep(0, ("h",)),
            WindowStep(int(0.98 * 80 / 1.25), ("b1",)),
            WindowStep(int(0.98 * 90 / 1.25), ("b0", "e")),
        )
    )
    assert window.shares
    assert grad_window(100, backward, 0.98, 1.25, 2) == GradWindow()  # accumulation: grads meet the next peak
    assert grad_window(100, [], 0.98, 1.25, 1) == GradWindow()  # no head found: nothing known freed
    assert not grad_window(100, [BackwardSegment(120, ["h"])], 1.0, 1.0, 1).shares


def _four_chunks(window: GradWindow) -> ArenaBytes:
    """One chunk per parameter, in use order a, b, c, head (so backward meets head, c, b, a)."""
    params = [nn.Parameter(torch.empty(128)) for _ in range(4)]
    names = [["a"], ["b"], ["c"], ["head.weight"]]
    layout = build_layout(params, names, [0] * 4, [False] * 4, world_size=1, chunk_size=128, alignment=8)
    return ArenaBytes(layout, BF16, ADAM_STATE["fp32"], window=window)


GRAD = 128 * 2


@pytest.mark.parametrize("slacks", [(0, 0, 0), (0, 300, 600), (0, 10_000, 10_000), (100, 300, 200)])
def test_device_grads_are_the_most_any_backward_step_holds_beyond_its_slack(slacks: tuple[int, int, int]) -> None:
    """Step by step the shards of the chunks backward has reached by then, less that step's slack:
    the head's at the peak, then c and b, then a."""
    window = GradWindow(
        (WindowStep(slacks[0], ("head.weight",)), WindowStep(slacks[1], ("c", "b")), WindowStep(slacks[2], ("a",)))
    )
    mem, every = _four_chunks(window), _four_chunks(GradWindow())
    for on in ([True] * 4, [True, True, True, False], [False, False, False, True], [True, False, False, False]):
        on_device = np.array(on)
        head, middle, first = GRAD * on[3], GRAD * (on[1] + on[2]), GRAD * on[0]
        expected = max(0, head - slacks[0], head + middle - slacks[1], head + middle + first - slacks[2])
        assert every.grads(on_device) == GRAD * sum(on)
        assert mem.grads(on_device) == expected
        assert mem.device(2, on_device) - every.device(2, on_device) == expected - GRAD * sum(on)


def test_a_chunk_counts_from_the_first_step_that_names_a_parameter_of_it_or_from_the_head() -> None:
    """A chunk whose parameters two steps name exists from the earlier; one no step names (its
    parameters did not appear in the profile) is counted at the peak, where nothing is freed."""
    named_twice = _four_chunks(
        GradWindow((WindowStep(0, ("head.weight",)), WindowStep(1000, ("c",)), WindowStep(5000, ("c", "b", "a"))))
    )
    assert named_twice.step.tolist() == [2, 2, 1, 0]
    unnamed = _four_chunks(GradWindow((WindowStep(0, ("head.weight",)), WindowStep(5000, ("c", "b")))))
    assert unnamed.step.tolist() == [0, 1, 1, 0]
    assert unnamed.grads(np.array([True, False, False, False])) == GRAD


def test_the_search_uses_the_window_only_where_gradients_share_activations() -> None:
    """Without expandable segments (``SearchSettings.grads_share_activations``) or with gradient
    accumulation, every gradient shard of the GPU counts beside the activations."""
    import dataclasses

    from search_cases import GIB, gpu_host, profiled

    from elixir_runtime.config import ElixirConfig
    from elixir_runtime.search import Budget, SearchSettings, search

    _, table, profile = profiled("llama", n_layer=4, batch=4, seq=64, vocab=4096)
    assert profile.late_peak is not None and profile.late_peak < profile.activation_peak
    budget = Budget(capacity=GIB, activations=profile.activation_peak, buffers=0, host_capacity=64 * GIB)
    settings = SearchSettings(1, BF16, ElixirConfig(offload=0.5))
    shared = search(table, profile, gpu_host(), budget, settings).grad_window
    assert shared.shares and "lm_head.weight" in shared.steps[0].params
    for other in (
        dataclasses.replace(settings, grads_share_activations=False),
        SearchSettings(1, BF16, ElixirConfig(offload=0.5, grad_accum_steps=2)),
    ):
        assert search(table, profile, gpu_host(), budget, other).grad_window == GradWindow()


@pytest.mark.parametrize("chunk_size, checkpointing", [(None, True), (4096, True), (4096, False)])
def test_each_window_step_holds_every_gradient_shard_the_engine_has_allocated_by_then(
    chunk_size, checkpointing
) -> None:
    """The engine beside its profile: when a block's backward starts, every chunk holding a
    gradient shard is one a window step before that block's names (a shard arriving earlier than
    its step would sit in activation memory the plan thinks is still in use)."""
    import elixir_runtime as er
    from elixir_runtime.profiler.profile import profile_model
    from helpers.models import make_batch, tiny_llama

    model = tiny_llama(n_layer=4, n_embd=32, vocab=512)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(512, batch=2, seq=32)
    profile = profile_model(model, batch, device="cpu")
    window = grad_window(profile.activation_peak, profile.backward, 1.0, 1.0, 1)
    config = er.ElixirConfig(mode="static", offload=0, chunk_size=chunk_size)
    model, opt = er.prepare(model, torch.optim.AdamW(model.parameters()), config=config, example_batch=batch)
    runtime = model._elixir.runtime
    step = ArenaBytes(runtime.layout, torch.float32, ADAM_STATE["fp32"], window=window).step
    layers = model.model.layers
    held: dict[int, list[int]] = {}

    def note(i: int) -> None:
        held.setdefault(i, [c.index for c in runtime.chunks if c.grad is not None])

    for i, layer in enumerate(layers):
        layer.register_full_backward_pre_hook(lambda m, g, i=i: note(i))
    for _ in range(2):  # the second step's shards are allocated afresh after zero_grad
        held.clear()
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        assert sorted(held) == list(range(len(layers)))
        for i, chunks in held.items():
            segment = len(layers) - i  # backward[0] is the head's, then the blocks last to first
            assert all(step[c] < segment for c in chunks), (i, chunks, step.tolist())
        assert any(held.values())  # the test saw shards arrive before backward ended
