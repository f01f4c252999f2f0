"""The predicted step time against steps measured on one H100 80GB (docs/benchmarks/results.json).

Each case is a plan the benchmark ran (``python -m benchmarks.throughput --gpus 1 --systems
elixir``: GPT-2 built from its config as ``benchmarks/models.py`` builds it, seq 1024, bf16, SDPA,
activation checkpointing on, no gradient clipping: ``clips_grads=False``), rebuilt here on the
meta device with the same chunk size, offloaded chunks and rCache size, and profiled on fake
tensors as ``elixir-plan`` does without a GPU. Issue 6's target: the measured step within 15 % of
the plan's prediction.

The offload-regime rows were measured after ``prefetch()`` stopped blocking on a chunk whose CPU
update is still running; the run's plans were priced with the hardware profile measured on that
machine then, and printed their compute, GPU Adam and CPU Adam totals. The cases here are priced
with the H100 profile shipped in src/elixir_runtime/hardware/profiles/h100.json (measured on the same machine
type) scaled so that those three totals are the run's: that machine's CPU Adam was 25 % slower
than the committed profile's, its compute 3 % slower. The in-GPU rows use the committed profile.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from benchmarks.models import Preset, build_meta
from elixir_runtime.config import ElixirConfig
from elixir_runtime.hardware import load_hardware
from elixir_runtime.plan import ElixirPlan, resolve_plan
from elixir_runtime.profiler import profile_model
from elixir_runtime.search import Budget, SearchSettings, search, step_time
from elixir_runtime.search.loop import _evaluate
from elixir_runtime.units import find_units, param_table
from tests.elixir_runtime.search.search_cases import cpu_adam_times

H100 = "h100"  # the profile shipped with the package (hardware/load.py SHIPPED)
BF16 = torch.bfloat16
GIB = 2**30

# (n_embd, n_layer, n_head), batch, (chunk size, chunks, offloaded, rCache blocks), measured step s,
# the run's printed plan: (total, compute, GPU Adam, CPU Adam total) s
OFFLOAD = {
    "6.5b-bs4": ((4096, 32, 32), 4, (68_617_600, 98, 44, 97), 0.759, (0.896, 0.458, 0.040, 0.548)),
    "6.5b-bs8": ((4096, 32, 32), 8, (68_617_600, 98, 48, 97), 1.034, (1.292, 0.916, 0.037, 0.598)),
    "6.5b-bs16": ((4096, 32, 32), 16, (205_852_672, 33, 18, 32), 1.802, (2.063, 1.833, 0.032, 0.673)),
}
IN_GPU = {
    "1.5b-bs8": ((1600, 48, 25), 8, (30_740_800, 50, 3, 49), 0.360),
    "1.5b-bs16": ((1600, 48, 25), 16, (30_740_800, 50, 3, 49), 0.660),
    "gpt2-4b-bs4": ((3072, 32, 24), 4, (113_286_144, 34, 2, 33), 0.339),
    "gpt2-4b-bs8": ((3072, 32, 24), 8, (113_286_144, 34, 2, 33), 0.608),
}


_PROFILED: dict[tuple, tuple] = {}


def _profiled(dims: tuple, batch: int) -> tuple:
    """(table, profile, units) of a model and batch, profiled once."""
    if (dims, batch) not in _PROFILED:
        model = build_meta(Preset("case", *dims), dtype=BF16)  # as the benchmark builds it
        units = find_units(model, None)
        ids = torch.zeros(batch, 1024, dtype=torch.long, device="meta")
        profile = profile_model(model, {"input_ids": ids, "labels": ids}, dtype=BF16, device="cuda", units=units)
        by_name = {u.name: u.index for u in units}
        order = [by_name[n] for n in profile.unit_order() if n in by_name]
        order += [u.index for u in units if u.index not in set(order)]
        _PROFILED[dims, batch] = param_table(model, units, order), profile, units
    return _PROFILED[dims, batch]


def _plan(case: tuple, hardware, clips_grads: bool = False, device_lane: bool = False) -> tuple:
    """(search result, table, profile, budget, units) of a case, the measured plan pinned."""
    dims, batch, (chunk_size, n_chunks, offloaded, n_blocks), *_ = case
    table, profile, units = _profiled(dims, batch)
    budget = Budget(hardware.gpu_memory, profile.activation_peak, profile.buffer_bytes, hardware.host_memory)
    settings = SearchSettings(
        1,
        BF16,
        ElixirConfig(
            chunk_size=chunk_size,
            n_blocks=n_blocks,
            offload=list(range(n_chunks - offloaded, n_chunks)),
            clips_grads=clips_grads,
            skip_nonfinite=False,  # the measured runs had no host sync before the update
        ),
        device_lane=device_lane,
    )
    return search(table, profile, hardware, budget, settings), table, profile, budget, units


def _run_machine(case: tuple, hardware):
    """The committed profile scaled so that the case's compute, GPU Adam and CPU Adam totals are
    the ones its run printed (measured on that machine then)."""
    _, printed_compute, printed_gpu_adam, printed_cpu_adam = case[4]
    t = _plan(case, hardware)[0].placement.time
    c, g, a = printed_compute / t.compute, printed_gpu_adam / t.gpu_adam, printed_cpu_adam / t.cpu_adam
    return dataclasses.replace(
        cpu_adam_times(hardware, 1 / a),
        matmul={k: v / c for k, v in hardware.matmul.items()},
        attention={k: v / c for k, v in hardware.attention.items()},
        memory_bandwidth=hardware.memory_bandwidth / c,
        op_overhead=hardware.op_overhead * c,
        gpu_adam=hardware.gpu_adam / g,
    )


_PLANNED: dict[tuple, tuple] = {}


def _planned(name: str, hardware, clips_grads: bool = False) -> tuple:
    """``_plan`` of a named case: offload-regime rows on their run's machine, in-GPU rows on the
    committed profile."""
    if (name, clips_grads) not in _PLANNED:
        case = {**OFFLOAD, **IN_GPU}[name]
        machine = _run_machine(case, hardware) if name in OFFLOAD else hardware
        _PLANNED[name, clips_grads] = (*_plan(case, machine, clips_grads), machine)
    return _PLANNED[name, clips_grads]


@pytest.fixture(scope="module")
def h100():
    return load_hardware(H100)


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_offload_regime_within_15_percent_of_the_measured_step(name, h100) -> None:
    case = OFFLOAD[name]
    result, table, _, _, units, _ = _planned(name, h100)
    (_, _, (chunk_size, n_chunks, offloaded, n_blocks), measured, printed) = case
    assert (
        result.chunk_size,
        len(result.placement.on_device),
        len(result.placement.offload),
        result.placement.n_blocks,
    ) == (chunk_size, n_chunks, offloaded, n_blocks)
    t = result.placement.time
    assert (t.compute, t.gpu_adam, t.cpu_adam) == pytest.approx(printed[1:], rel=1e-6)
    assert abs(t.total / measured - 1) <= 0.15, (name, t)
    # the CPU Adam is partly hidden under the backward and the next forward, never all exposed
    assert 0 <= t.exposed_cpu_adam < t.cpu_adam
    # the plan carries the same prediction
    plan = resolve_plan(ElixirConfig(), table, result.layout, BF16, search=result).plan
    assert plan.predicted_step_s == pytest.approx(t.total)
    assert ElixirPlan.from_json(plan.to_json()).predicted_step_s == pytest.approx(t.total)
    assert any("during backward" in n for n in plan.search.notes)


@pytest.mark.parametrize("name", list(OFFLOAD))
def test_with_a_host_sync_the_updates_start_after_backward(name, h100) -> None:
    """``clips_grads=True`` is how these runs stepped (a host sync, updates after backward): on the
    run's machine the prediction is within 15 % of the measured step. The runs printed 0.896 /
    1.292 / 2.063 s (the CPU Adam at its rate under copies) for 0.759 / 1.034 / 1.802 s measured;
    after a synced backward the CPU updates at its rate alone (step_time's docstring): 0.657 /
    1.028 / ~1.8 s now. Without the sync the same updates run beside backward's copies, at the
    rate under copies."""
    measured = OFFLOAD[name][3]
    synced = _planned(name, h100, clips_grads=True)[0].placement.time
    free = _planned(name, h100)[0].placement.time
    assert synced.total == pytest.approx(measured, rel=0.15)
    assert (free.compute, free.gpu_adam) == (synced.compute, synced.gpu_adam)
    rates = h100.rates(1)
    _assert_alone_beside_fetches(synced, free.cpu_adam * step_time.ARENA_RATE * rates.cpu_adam, rates)


def _assert_alone_beside_fetches(t, elements: float, rates) -> None:
    """After a synced backward the CPU works at its rate alone (on the engine's arenas), plus what
    the forward's uploads of the offloaded chunks (at most all of ``t.h2d``) take from it
    (``step_time.fetch_drag``)."""
    alone = elements / (step_time.ARENA_RATE * rates.cpu_adam_alone)
    drag = step_time.fetch_drag(rates)
    assert 0 < drag < 1
    assert alone < t.cpu_adam < alone + drag * t.h2d


def test_exposed_cpu_adam_shrinks_as_the_forward_grows(h100) -> None:
    """Measured: step - compute - GPU Adam = 0.26 / 0.08 / about 0 s at batch 4 / 8 / 16."""
    exposed = [_planned(n, h100)[0].placement.time.exposed_cpu_adam for n in OFFLOAD]
    assert exposed[0] > exposed[1] >= exposed[2]
    assert exposed[0] > 0.15 and exposed[2] < 0.03


@pytest.mark.parametrize("name", list(IN_GPU))
def test_in_gpu_regime_within_15_percent_of_the_measured_step(name, h100) -> None:
    case = IN_GPU[name]
    t = _planned(name, h100)[0].placement.time
    assert abs(t.total / case[-1] - 1) <= 0.15, (name, t)


def _model(name: str, h100, clips_grads: bool = False):
    result, table, profile, budget, _, machine = _planned(name, h100, clips_grads)
    settings = SearchSettings(1, BF16, ElixirConfig(clips_grads=clips_grads, skip_nonfinite=False))
    return _evaluate(result.chunk_size, table, profile, machine.rates(1), budget, settings).model, result


def test_forward_timeline_places_the_units_own_compute(h100) -> None:
    """Each block starts after the blocks before it ran: the chunk-first-use times rise through the
    forward to near its end (block replay leaves the blocks' compute out of the unit events)."""
    model, _ = _model("6.5b-bs16", h100)
    need = model.first_need
    assert np.all(np.diff(need) >= 0)
    # the last chunk (the last block and the final norm) is first needed in the last block's forward
    n_layer = OFFLOAD["6.5b-bs16"][0][1]
    assert need[-1] == pytest.approx(model.compute_fwd * (n_layer - 1) / (n_layer + 1), rel=0.05)


def test_backward_timeline_completes_the_last_chunks_first(h100) -> None:
    """Gradients complete in reverse chunk order: the last chunk's after the head and the last
    block, the first (embeddings) at the end of backward; one block's backward apart."""
    model, _ = _model("6.5b-bs16", h100)
    ready = model.grad_ready
    assert np.all(np.diff(ready) <= 0)
    assert ready[0] == pytest.approx(model.compute_bwd)
    n_layer = OFFLOAD["6.5b-bs16"][0][1]
    block = model.compute_bwd / (n_layer + 1)  # a block's share; the head's is about one more
    assert 0 < ready[-1] < 3 * block
    # chunks of one block each (with the final norm, the embeddings): one block's backward apart
    assert np.diff(ready[2:]) == pytest.approx(-block, rel=0.05)


def test_without_a_host_sync_the_offloaded_updates_start_during_backward(h100) -> None:
    """The offloaded chunks (the last ones) have their gradients first: their updates may start
    while the backward still runs over the GPU-resident chunks; after a sync, at its end."""
    name = "6.5b-bs16"
    for clips in (False, True):
        model, result = _model(name, h100, clips)
        on_device = np.ones(model.k, dtype=bool)
        on_device[result.placement.offload] = False
        host = ~on_device & model.trainable
        r = model.rates
        reduce = (model._transfer(on_device, r.duplex or r.d2h) + model.coll) * model.trainable
        start = model.update_start(host, reduce)
        if clips:
            assert np.all(start == 0)
            continue
        first = result.placement.offload[0]
        # the backward left after the first offloaded chunk's gradients: the GPU-resident chunks'
        left = model.compute_bwd - model.grad_ready[first]
        assert start[first] == pytest.approx(-left, rel=0.05)
        assert np.all(np.diff(start[result.placement.offload]) < 0)  # the later chunks' even earlier
        assert np.all(start[on_device] == 0)


@pytest.mark.parametrize("clips_grads", [False, True])
def test_more_gpu_memory_never_offloads_more_on_the_h100(h100, clips_grads) -> None:
    """The auto search for the 6.5B at batch 8 over GPU sizes from 'barely fits' to 'fits whole':
    the serial step it minimises and the bytes it offloads never grow with memory, and the
    predicted step ends far below where it started."""
    _, table, profile, _, _, _ = _planned("6.5b-bs8", h100)
    serial, offloaded, times = [], [], []
    for gib in (24, 32, 40, 48, 56, 64, 72, 80, 96, 112, 128, 160):
        budget = Budget(gib * GIB, profile.activation_peak, profile.buffer_bytes, h100.host_memory)
        r = search(
            table,
            profile,
            h100,
            budget,
            SearchSettings(1, BF16, ElixirConfig(clips_grads=clips_grads, skip_nonfinite=False)),
        )
        assert r.placement.device_bytes <= budget.allowed and r.placement.host_bytes <= budget.host_allowed
        serial.append(r.placement.time.serial)
        offloaded.append(r.placement.host_bytes)
        times.append(r.placement.time.total)
    assert all(b <= a + 1e-12 for a, b in zip(serial, serial[1:])), serial
    assert all(b <= a for a, b in zip(offloaded, offloaded[1:])), offloaded
    assert offloaded[-1] == 0 and times[-1] < 0.8 * times[0]


@pytest.mark.parametrize("cpu_adam_scale", [1, 4])
@pytest.mark.parametrize("clips_grads", [False, True])
def test_states_that_fit_stay_on_the_h100(h100, cpu_adam_scale, clips_grads) -> None:
    """GPT-2 1.5B at batch 8 fits one H100 whole. However fast the host's CPU Adam, offloading
    is never chosen to save the GPU Adam: on the H100 a plan with two thirds of it offloaded (its
    overlapped prediction 0.33 s) ran 0.44 s against 0.36 s all on the GPU."""
    table, profile, _ = _profiled((1600, 48, 25), 8)
    machine = cpu_adam_times(h100, cpu_adam_scale)
    budget = Budget(h100.gpu_memory, profile.activation_peak, profile.buffer_bytes, h100.host_memory)
    r = search(
        table,
        profile,
        machine,
        budget,
        SearchSettings(1, BF16, ElixirConfig(clips_grads=clips_grads, skip_nonfinite=False)),
    )
    assert r.placement.offload == [], f"{len(r.placement.offload)} of {len(r.placement.on_device)} chunks offloaded"


def test_device_lane_shares_the_update_after_a_clipped_backward(h100) -> None:
    """The 6.5b-bs4 plan pinned, clipping on (the updates start after backward): with the device
    lane the CPU and the lane split the offloaded elements, the lane at the link's duplex rate for
    14 B each way (bf16), and the forward waits for less."""
    case = OFFLOAD["6.5b-bs4"]
    off = _plan(case, h100, clips_grads=True)[0].placement.time
    result = _plan(case, h100, clips_grads=True, device_lane=True)[0]
    on, rates = result.placement.time, h100.rates(1)
    lane_rate = min(rates.duplex / 14, rates.gpu_adam)
    assert result.device_lane and off.device_lane_adam == 0 < on.device_lane_adam
    # beside the lane the CPU updates under its copies; after a clipped backward without it, alone
    cpu_rate, cpu_alone = step_time.ARENA_RATE * rates.cpu_adam, step_time.ARENA_RATE * rates.cpu_adam_alone
    elements = on.cpu_adam * cpu_rate + on.device_lane_adam * lane_rate
    _assert_alone_beside_fetches(off, elements, rates)
    assert on.cpu_adam == pytest.approx(on.device_lane_adam, rel=0.1)  # the two rates are close on an H100
    faster = cpu_rate + lane_rate > cpu_alone
    assert (on.exposed_cpu_adam < off.exposed_cpu_adam) == faster


def test_two_lanes_meet_where_their_rates_say(monkeypatch) -> None:
    """Slices in chunk order: the CPU from the front, the lane from the back, each the next when free."""
    monkeypatch.setattr(step_time, "LANE_SLICE", 1)
    done, cpu, lane = step_time._two_lanes(np.zeros(2), np.array([4.0, 4.0]), 1.0, 3.0)
    assert done.tolist() == pytest.approx([2.0, 4 / 3]) and (cpu, lane) == pytest.approx((2.0, 2.0))
    # the back chunk's gradients land late: the lane waits for them while the CPU does the front
    # chunk, then both share the back one
    done, cpu, lane = step_time._two_lanes(np.array([0.0, 10.0]), np.array([4.0, 4.0]), 1.0, 1.0)
    assert done.tolist() == pytest.approx([4.0, 12.0]) and (cpu, lane) == pytest.approx((6.0, 2.0))


def test_the_roofline_splits_by_kind_of_kernel() -> None:
    """GEMMs (and convolutions) at their size class's rate, attention at its length's, bytes at the
    memory-bound ops' rate: the parts sum to the roofline the step model prices."""
    from elixir_runtime.profiler.timeline import Cost
    from tests.elixir_runtime.search.search_cases import gpu_host

    hw = dataclasses.replace(gpu_host(), attention={"1024": 200e12, "4096": 400e12}, elementwise=1.5e12)
    rates = hw.rates(1)
    cost = Cost(flops={"4096": 600e12, "256": 50e12, "attention:4096": 400e12, "attention:1000": 100e12}, bytes=3e12)
    parts = step_time.roofline_parts(cost, rates)
    assert parts == pytest.approx({"gemm": 2.0, "attention": 1.5, "memory": 2.0})
    assert sum(parts.values()) == pytest.approx(step_time.roofline(cost, rates))
