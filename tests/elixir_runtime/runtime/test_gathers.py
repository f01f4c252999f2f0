"""What a gather waits for on the fetch stream ([Note: uploads ahead of compute] in ``runtime/gathers.py``):
the buffer's last user always, the compute stream's work so far only for a shard the GPU holds."""

from __future__ import annotations

import contextlib

import torch

import elixir_runtime as er
import elixir_runtime.runtime.gathers as gathers
from elixir_runtime.chunk.rcache import Buffer
from helpers.dist import run_distributed
from helpers.training import Recipe, batch_for, build


class _Stream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait_stream(self, other) -> None:
        self.log.append(f"wait_stream {other}")

    def wait_event(self, event) -> None:
        self.log.append(f"wait_event {event}")


def _waits(monkeypatch, after_compute: bool, free_event) -> list[str]:
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    buffer = Buffer(0, torch.empty(0), free_event=free_event)
    with gathers.on_stream(_Stream(log), buffer, torch.device("cuda"), after_compute=after_compute):
        log.append("gather")
    return log


def test_a_gather_after_compute_waits_for_the_compute_stream_then_the_buffer(monkeypatch):
    assert _waits(monkeypatch, True, "freed") == ["wait_stream compute", "wait_event freed", "gather"]


def test_an_upload_waits_only_for_the_buffers_last_user(monkeypatch):
    assert _waits(monkeypatch, False, "freed") == ["wait_event freed", "gather"]
    assert _waits(monkeypatch, False, None) == ["gather"]  # a buffer never used: nothing to wait for


def _after_compute_by_chunk(rank: int = 0, world_size: int = 1) -> tuple[set[int], dict[int, set[bool]]]:
    """One step with half the chunks offloaded (every rank on the same batch): the offloaded chunks,
    and each gathered chunk's ``after_compute`` values."""
    recipe = Recipe(steps=2)
    model, opt = build(recipe)
    cfg = er.ElixirConfig(mode="static", n_blocks="min", offload=0.5, prefetch=2)
    model, opt = er.prepare(model, opt, cfg, example_batch=batch_for(recipe, 0, 0, 0))
    seen: dict[int, set[bool]] = {}
    on_stream = gathers.on_stream

    def recorded(stream, buffer, device, after_compute=True):
        seen.setdefault(buffer.chunk, set()).add(after_compute)
        return on_stream(stream, buffer, device, after_compute)

    gathers.on_stream = recorded
    try:
        opt.backward(model(**batch_for(recipe, 0, 0, 0)).loss)
        opt.step()
    finally:
        gathers.on_stream = on_stream
    return set(model._elixir.plan.offload), seen


def test_only_offloaded_shards_gather_ahead_of_the_compute_stream():
    offloaded, seen = _after_compute_by_chunk()
    assert offloaded and set(seen) > offloaded  # both kinds were gathered
    assert seen == {i: {i not in offloaded} for i in seen}


def test_with_several_ranks_every_gather_follows_the_compute_stream():
    for offloaded, seen in run_distributed(_after_compute_by_chunk, 2, timeout=120):
        assert offloaded and set(seen) > offloaded
        assert seen == {i: {True} for i in seen}
