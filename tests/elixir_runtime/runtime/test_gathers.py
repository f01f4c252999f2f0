"""What a gather waits for on the fetch stream ([Note: uploads ahead of compute] in ``runtime/gathers.py``):
the buffer's last user always, the compute stream's work so far only for a shard the GPU holds."""

from __future__ import annotations

import contextlib

import torch

import elixir_runtime as er
import elixir_runtime.runtime.gathers as gathers
from elixir_runtime.chunk.rcache import Buffer
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


def test_only_offloaded_shards_gather_ahead_of_the_compute_stream(monkeypatch):
    recipe = Recipe(steps=2)
    model, opt = build(recipe)
    cfg = er.ElixirConfig(mode="static", n_blocks="min", offload=0.5, prefetch=2)
    model, opt = er.prepare(model, opt, cfg, example_batch=batch_for(recipe, 0, 0, 0))
    offloaded = set(model._elixir.plan.offload)
    seen: dict[int, set[bool]] = {}
    on_stream = gathers.on_stream

    def recorded(stream, buffer, device, after_compute=True):
        seen.setdefault(buffer.chunk, set()).add(after_compute)
        return on_stream(stream, buffer, device, after_compute)

    monkeypatch.setattr(gathers, "on_stream", recorded)
    opt.backward(model(**batch_for(recipe, 0, 0, 0)).loss)
    opt.step()
    assert offloaded and set(seen) > offloaded  # both kinds were gathered
    assert seen == {i: {i not in offloaded} for i in seen}
