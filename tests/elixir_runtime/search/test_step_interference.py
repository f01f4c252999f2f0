"""What work running side by side costs in the step model (search/step_time.py): a collective
hidden under compute still slows it, a CPU update after a synced backward shares host memory
with the forward's uploads of offloaded chunks, and a forward without prefetching waits for the
updates and its own gathers at once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from search_cases import GIB, gpu_host, profiled

from elixir_runtime.config import ElixirConfig
from elixir_runtime.hardware.profile import CpuAdamRate
from elixir_runtime.search import Budget, SearchSettings
from elixir_runtime.search.access import FWD
from elixir_runtime.search.loop import _evaluate
from elixir_runtime.search.step_time import ARENA_RATE, COLLECTIVE_DRAG, fetch_drag

BF16 = torch.bfloat16
CHUNK = 16384


@pytest.fixture(scope="module")
def gpt2():
    return profiled("gpt2", n_layer=6, n_embd=64)


def _model(gpt2, hardware, ranks: int = 1, busbw: float | None = None, **config):
    _, table, profile = gpt2
    budget = Budget(64 * GIB, profile.activation_peak, profile.buffer_bytes, 64 * GIB, ranks)
    settings = SearchSettings(ranks, BF16, ElixirConfig(**config))
    e = _evaluate(CHUNK, table, profile, hardware.rates(ranks, busbw, ranks), budget, settings)
    return e.model, e.min_blocks


def _host(cpu_adam: float, under_over_alone: float):
    """The test host with a CPU Adam of ``cpu_adam`` alone and ``under_over_alone`` of it under copies."""
    rate = CpuAdamRate(1, 15, cpu_adam * under_over_alone, cpu_adam)
    return dataclasses.replace(gpu_host(cpu_adam=cpu_adam), cpu_adam={1: rate})


def test_a_collective_hidden_under_compute_still_slows_it(gpt2) -> None:
    """Prefetching hides the all-gathers and reduce-scatters, yet the step is longer than the
    compute by ``COLLECTIVE_DRAG`` of their time (plus the exposed first gather and last
    reduction); the copy engines' H2D and D2H of offloaded chunks take nothing from it."""
    model, lo = _model(gpt2, gpu_host(2), ranks=2, busbw=5e8)
    every = np.ones(model.k, dtype=bool)
    t = model.step(lo + 1, every)
    gather = model._device_copy(every) + model.coll  # from the GPU's own arena, then the all-gather
    # a gather reads the fp32 master, the last reduction writes the shard ([Note: ...] gather_read)
    reduce = model._device_copy(every, gather=False) + model.coll
    head, tail = gather[model.first], reduce[model.last]
    # a group's misses beyond the one spare block gather in line ([Note: gathers in line]), undragged
    inline = model.table.inline(lo + 1).sum(axis=0)
    hidden = t.collectives - float(inline @ model.coll)
    expected = COLLECTIVE_DRAG * hidden + float(inline @ gather) + head + tail
    assert t.exposed_transfers == pytest.approx(expected, rel=1e-6)
    assert t.exposed_transfers > 0.3 * t.collectives > 0
    # one rank, the last half offloaded, the links fast enough to hide, and blocks enough to
    # prefetch every miss (each block past the minimum frees one per group): only the ends
    model, lo = _model(gpt2, gpu_host(1, cpu_adam=1e12))
    host = np.ones(model.k, dtype=bool)
    host[model.k // 2 :] = False
    free = next(n for n in range(lo + 1, lo + model.k) if not model.table.inline(n).any())
    assert model.table.inline(lo + 1).any()  # one spare block is not enough
    t = model.step(free, host)
    assert t.collectives == 0 and t.h2d > 0
    assert t.exposed_transfers < 0.1 * (t.h2d + t.d2h)


def test_fetch_drag_is_the_share_of_the_loss_under_copies_one_upload_causes() -> None:
    rates = _host(6e9, 0.5).rates(1)  # links: 50 GB/s each way alone, 35 GB/s each way at once
    assert fetch_drag(rates) == pytest.approx(50 / 70 * 0.5)
    assert fetch_drag(_host(6e9, 1.0).rates(1)) == 0  # copies cost the update nothing
    assert fetch_drag(dataclasses.replace(rates, cpu_adam_alone=None)) == 0  # only one rate measured


def test_a_host_bound_update_after_a_synced_backward_shares_host_memory_with_the_uploads(gpt2) -> None:
    """After a synced backward the worker updates chunk k while the forward uploads chunk k - 1:
    each update but the first is longer by ``fetch_drag`` of one upload; the forward, waiting for
    the last one, by as much. Without the sync (updates beside backward) the rate under copies
    already holds the contention, and the uploads add nothing."""
    slow = 2e6  # elements/s: the forward waits for the updates
    model, lo = _model(gpt2, _host(slow, 0.5), clips_grads=True)
    free, _ = _model(gpt2, _host(slow, 1.0), clips_grads=True)  # the same, copies costing nothing
    host = np.ones(model.k, dtype=bool)
    host[model.k // 2 :] = False
    offloaded = np.flatnonzero(~host & model.trainable)
    assert len(offloaded) > 2
    t, t_free = model.step(lo + 1, host), free.step(lo + 1, host)
    uploads = float((model.shard[offloaded] / model.rates.h2d)[:-1].sum())
    extra = fetch_drag(model.rates) * uploads
    assert extra > 0
    assert t.cpu_adam - t_free.cpu_adam == pytest.approx(extra, rel=1e-6)
    assert t_free.exposed_cpu_adam > 0  # host-bound
    assert t.exposed_cpu_adam - t_free.exposed_cpu_adam == pytest.approx(extra, rel=1e-6)
    # no host sync: the rate under copies, no drag on top
    unsynced, _ = _model(gpt2, _host(slow, 0.5), clips_grads=False, skip_nonfinite=False)
    u = unsynced.step(lo + 1, host)
    assert unsynced.fetch_drag == 0
    assert u.cpu_adam == pytest.approx(float(unsynced.elements[offloaded].sum()) / (ARENA_RATE * model.rates.cpu_adam))


def test_a_rate_observed_on_this_machine_prices_the_updates_after_a_synced_backward(gpt2) -> None:
    """As it ran in a job here, the uploads beside it included: no ``ARENA_RATE``, no drag. Updates
    during backward keep the profile's rate under copies (no job observes those)."""
    slow = 2e6
    host_rate = _host(slow, 0.5)
    observed = dataclasses.replace(
        host_rate, cpu_adam={1: dataclasses.replace(host_rate.cpu_adam[1], observed=0.7 * slow)}
    )
    model, lo = _model(gpt2, observed, clips_grads=True)
    assert model.cpu_rate == 0.7 * slow and model.fetch_drag == 0
    host = np.ones(model.k, dtype=bool)
    host[model.k // 2 :] = False
    offloaded = np.flatnonzero(~host & model.trainable)
    assert model.step(lo + 1, host).cpu_adam == pytest.approx(float(model.elements[offloaded].sum()) / (0.7 * slow))
    unsynced, _ = _model(gpt2, observed, clips_grads=False, skip_nonfinite=False)
    assert unsynced.cpu_rate == ARENA_RATE * unsynced.rates.cpu_adam
    _, table, profile = gpt2
    budget = Budget(64 * GIB, profile.activation_peak, profile.buffer_bytes, 64 * GIB, 1)
    settings = SearchSettings(1, BF16, ElixirConfig(clips_grads=True), device_lane=True)
    lane = _evaluate(CHUNK, table, profile, observed.rates(1), budget, settings).model
    assert lane.cpu_rate == ARENA_RATE * lane.rates.cpu_adam  # beside the lane: under copies


def _forward_with_waits(model, n_blocks: int, host: np.ndarray, start: float) -> float:
    """The forward without prefetching, simulated chunk by chunk: the compute up to each chunk's
    first need, the wait for its update if it is offloaded (the updates run one after another
    from the end of a synced backward, the forward starting ``start`` later), then its gather;
    re-gathers after the last chunk."""
    mine = np.flatnonzero(~host & model.trainable)
    done = dict(zip(mine, np.cumsum(model.elements[mine] / model.cpu_rate) - start))
    gather = model._transfer(host, model.rates.h2d) + model.coll
    misses = model.misses(n_blocks)[FWD]
    t = reached = 0.0
    for k in sorted(range(model.k), key=lambda k: (model.first_need[k], k)):
        t += model.first_need[k] - reached
        reached = model.first_need[k]
        t = max(t, done.get(k, 0.0)) + min(misses[k], 1) * gather[k]
    return t + model.compute_fwd - reached + float((np.maximum(misses - 1, 0) * gather).sum())


@pytest.mark.parametrize("ranks, prefetch", [(1, 1), (2, 1), (1, 0)])
def test_without_prefetching_the_forward_waits_for_updates_between_its_in_line_gathers(gpt2, ranks, prefetch) -> None:
    """With no block to prefetch into (the rCache at its minimum, or ``prefetch=0``) the forward
    gathers each chunk when it reaches it, after its in-line gathers of the chunks before, and
    waits there for the chunk's update: the step is the simulated forward's, and shorter than
    the gathers plus the waits counted from the compute alone ([Note: in-line gathers and late
    updates])."""

    def model_at(cpu_adam: float):
        return _model(gpt2, gpu_host(ranks, cpu_adam), ranks, 5e8 if ranks > 1 else None, prefetch=prefetch)[0]

    slow, fast = model_at(2e6), model_at(1e15)  # host-bound; never waited for
    n_blocks = slow.min_blocks + (1 - prefetch)  # prefetch=0: a block more still prefetches nothing
    host = np.ones(slow.k, dtype=bool)
    host[slow.k // 2 :] = False
    t, t_fast = slow.step(n_blocks, host), fast.step(n_blocks, host)
    start = t.gpu_adam + len(np.flatnonzero(~host & slow.trainable)) * slow.rates.op_overhead  # + submissions
    gathers = float((slow.misses(n_blocks)[FWD] * (slow._transfer(host, slow.rates.h2d) + slow.coll)).sum())
    waited = _forward_with_waits(slow, n_blocks, host, start) - (slow.compute_fwd + gathers)
    assert waited > 0
    assert t.total - t_fast.total == pytest.approx(waited, rel=1e-9)
    mine = np.flatnonzero(~host & slow.trainable)
    from_compute = max(np.cumsum(slow.elements[mine] / slow.cpu_rate) - start - slow.first_need[mine])
    assert waited < from_compute


def test_a_chunk_the_root_acquires_is_needed_when_the_forward_starts_and_updated_first() -> None:
    """A parameter read outside its unit (``prepare``'s ``resident``) gets a private chunk the
    root's pre-forward acquires: offloaded, its update must be done and uploaded before the
    forward's first unit, so the host thread updates it first (``ChunkRuntime.update_order``)."""
    case = profiled("gpt2", n_layer=6, n_embd=64, resident=("transformer.ln_f.weight",))
    model, lo = _model(case, gpu_host(1, cpu_adam=2e3), clips_grads=True)
    root = list(model.layout.chunks_of([case[1].by_name["transformer.ln_f.weight"]]))
    assert model.first_need[root].max() == 0 < model.unit_start[-1]
    host = np.ones(model.k, dtype=bool)
    host[root] = False
    upload = float(model._transfer(host, model.rates.h2d)[root].max())
    update = float(model.elements[root].sum() / model.cpu_rate)

    def exposed(host: np.ndarray) -> float:
        t = model.step(lo + 1, host)
        submit = int((~host & model.trainable).sum()) * model.rates.op_overhead
        return t.exposed_cpu_adam - submit + t.gpu_adam + submit  # the wait, from the end of backward

    assert exposed(host) == pytest.approx(update + upload, rel=1e-9)  # only the root's chunk offloaded
    host[: model.k // 2] = False  # and the first half, updated after it
    others = [k for k in np.flatnonzero(~host & model.trainable) if k not in root]
    assert others and root[0] > max(others)  # last in chunk order
    order = root + others
    done = np.cumsum(model.elements[order] / model.cpu_rate)
    gather = model._transfer(host, model.rates.h2d)
    # A chunk gathered in line ([Note: gathers in line]: no free block while the group before
    # computes) is uploaded when the forward reaches it, after the in-line gathers of the chunks
    # needed before it (the root's first): its upload is the forward's, not a lead on its update.
    inline = model.inline(lo + 1, overlap=True)[FWD] > 0
    assert inline[order[-1]] and not inline[root].any()  # the last one updated is gathered in line

    def key(c: int) -> tuple[float, bool, int]:
        return float(model.first_need[c]), c not in root, c

    later = [sum(gather[j] for j in np.flatnonzero(inline) if key(j) < key(c)) for c in order]
    lead = np.where(inline[order], -np.array(later), gather[order])
    assert exposed(host) == pytest.approx(max(done + lead - model.first_need[order]), rel=1e-9)
