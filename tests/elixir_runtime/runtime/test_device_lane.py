"""The device update lane (``runtime/device_lane.py``, ``runtime/host_updates.py``) against plain
PyTorch, on CPU: the "device" is the CPU, its kernel the torch reference, so the slicing, the
split between the lanes and the exactness are the code a GPU runs. Slices are made small
(``LANE_SLICE``) so every chunk is cut into many and both lanes take several. Unused parameters
(per-parameter step counts) and two gloo ranks with the lane: ``test_frozen_unused.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.runtime import device_lane
from elixir_runtime.runtime.host_updates import HostUpdates
from elixir_runtime.runtime.stats import StatsCounter
from helpers.device import ON_CUDA
from helpers.training import Recipe, assert_close_losses, build, max_weight_diff, run_elixir, run_reference

LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-5  # test_parity.py's: only summation orders differ
SLICE = 4096


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(device_lane, "LANE_SLICE", SLICE)


def _offloaded_numel(recipe: Recipe, offload: float) -> int:
    model, _ = er.prepare(*build(recipe), config=er.ElixirConfig(mode="static", n_blocks="min", offload=offload))
    rt = model._elixir.runtime
    return sum(c.shard_numel for c in rt.trainable if c.shards is rt.arenas["host"])


@pytest.mark.parametrize("offload", [0.5, 1.0])
@pytest.mark.parametrize("clip", [1.0, 1e6], ids=["clipped", "clip-coef-1"])
def test_lane_matches_pytorch_and_each_element_is_updated_once(small_slices, offload, clip):
    recipe = Recipe(model="llama", steps=6, grad_accum=2, clip=clip)
    want = run_reference(recipe)
    got = run_elixir(recipe, n_blocks="min", offload=offload, device_assisted_update=True)
    assert_close_losses(got.losses, want.losses, LOSS_RTOL)
    assert max_weight_diff(got.state, want.state) < WEIGHT_ATOL
    cpu, device = got.stats["updated_cpu"], got.stats["updated_device"]
    assert cpu > SLICE and device > SLICE  # both lanes took several slices
    assert cpu + device == recipe.steps * _offloaded_numel(recipe, offload)  # every element once a step


def test_lane_with_params_larger_than_a_chunk(monkeypatch):
    """Chunks of 2048 elements: tiny Llama's embedding and lm_head (4096) get private chunks of
    their own; offloaded, the lanes cut them into slices like any other shard."""
    monkeypatch.setattr(device_lane, "LANE_SLICE", 1024)
    recipe = Recipe(model="llama", steps=6)
    want = run_reference(recipe)
    got = run_elixir(recipe, n_blocks="min", offload=1.0, device_assisted_update=True, chunk_size=2048)
    assert_close_losses(got.losses, want.losses, LOSS_RTOL)
    assert max_weight_diff(got.state, want.state) < WEIGHT_ATOL
    model, _ = er.prepare(*build(recipe), config=er.ElixirConfig(mode="static", chunk_size=2048, offload=1.0))
    rt = model._elixir.runtime
    assert [c.spec.numel for c in rt.trainable if c.spec.private] == [4096, 4096]
    assert got.stats["updated_device"] > 1024 and got.stats["updated_cpu"] > 1024
    assert got.stats["updated_cpu"] + got.stats["updated_device"] == recipe.steps * sum(
        c.shard_numel for c in rt.trainable
    )


def test_clip_coefficient_below_one_in_the_clipped_case():
    """The ``clipped`` case above really scales the gradients (its norms are above 1.0)."""
    recipe = Recipe(model="llama")
    model, opt = build(recipe, on_device=True)
    from helpers.training import batch_for

    model(**batch_for(recipe, 0, 0, None)).loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 1.0


def test_lane_bf16_matches_the_cpu_alone(small_slices):
    """bf16: the lane also writes the compute-dtype param shard the gathers read."""
    recipe = Recipe(model="gpt2", steps=5, dtype=torch.bfloat16)
    alone = run_elixir(recipe, n_blocks="min", offload=1.0, device_assisted_update=False)
    both = run_elixir(recipe, n_blocks="min", offload=1.0, device_assisted_update=True)
    assert alone.stats["updated_device"] == 0 and both.stats["updated_device"] > 0
    assert_close_losses(both.losses, alone.losses, 1e-2)
    assert max_weight_diff(both.state, alone.state) <= 2**-7  # at most a bf16 rounding apart


def test_plan_counts_the_staging_it_allocates(small_slices):
    recipe = Recipe(model="llama")
    on, _ = er.prepare(*build(recipe), config=er.ElixirConfig(mode="static", offload=0.5, device_assisted_update=True))
    plan, lane = on._elixir.plan, on._elixir.runtime.host_updates.lane
    buffers = [*lane._grads, *(t for s in lane._states for t in s.tensors.values())]
    allocated = sum(t.numel() * t.element_size() for t in buffers)
    assert plan.device_lane == lane.numel == SLICE and plan.memory.lane_staging == allocated > 0
    assert plan.device_bytes == (
        plan.memory.rcache + plan.memory.private + plan.memory.device_shards + plan.memory.device_grads + allocated
    )
    # "auto": a static plan keeps the lane on a GPU (no search to weigh it), never on a CPU device
    for setting, lane_elements in ((False, 0), ("auto", SLICE if ON_CUDA else 0)):
        other, _ = er.prepare(
            *build(recipe), config=er.ElixirConfig(mode="static", offload=0.5, device_assisted_update=setting)
        )
        assert other._elixir.plan.device_lane == lane_elements
        assert (other._elixir.plan.memory.lane_staging > 0) == (lane_elements > 0)
        assert (other._elixir.runtime.host_updates.lane is None) == (lane_elements == 0)
    nothing, _ = er.prepare(
        *build(recipe), config=er.ElixirConfig(mode="static", offload=0, device_assisted_update=True)
    )
    assert nothing._elixir.plan.device_lane == 0 and nothing._elixir.runtime.host_updates.lane is None


# ----------------------------------------------------------------- the lane alone, on CPU and GPU


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lane_slices_match_the_cpu_kernel(device, dtype):
    """An arena updated slice by slice through the staging buffers (two groups, segments cut at
    slice edges, a gap left alone) equals the C++ kernel over the whole arena; the param shard the
    gather reads is exactly its master's cast."""
    from types import SimpleNamespace

    from elixir_runtime.adam_state import ADAM_STATE, AdamTensors
    from elixir_runtime.chunk.host_memory import empty_host
    from elixir_runtime.chunk.layout import GroupRange
    from elixir_runtime.chunk.store import ShardArenas
    from elixir_runtime.kernels.cpu_adam import CpuAdamKernel
    from elixir_runtime.kernels.kernel import AdamHyper
    from elixir_runtime.runtime.device_lane import DeviceLane, slice_updates

    n, pin = 3 * SLICE + 1000, device == "cuda"
    g = torch.Generator().manual_seed(0)

    def arena(dt, scale=1.0):
        t = empty_host(n, dt, pin=pin)
        t.copy_(torch.randn(n, generator=g) * scale)
        return t

    def arenas():
        master = arena(torch.float32)
        param = master if dtype == torch.float32 else arena(dtype).copy_(master)  # as build_arenas fills it
        moments = {"exp_avg": arena(torch.float32, 0.01), "exp_avg_sq": arena(torch.float32, 1e-4).abs_()}
        state = AdamTensors(ADAM_STATE["fp32"], {"master": master, **moments})
        return ShardArenas("host", torch.device("cpu"), param, arena(dtype, 0.1), state, n)

    ours = arenas()
    g.manual_seed(0)
    want = arenas()
    segments = [GroupRange(0, SLICE + 100, 0), GroupRange(SLICE + 164, 2 * SLICE - 200, 1)]  # the rest: unused
    hypers = [AdamHyper(1e-2, 0.9, 0.999, 1e-6, 0.1, True), AdamHyper(3e-3, 0.8, 0.99, 1e-8, 0.0, False)]
    chunk = SimpleNamespace(index=0, offset=0, shard_numel=n, shards=ours, reduced_event=None, gathered=None)
    lane = DeviceLane(SLICE, torch.device(device), dtype, ADAM_STATE["fp32"])
    jobs = slice_updates(chunk, [(3, segments)], hypers, 2.5, lane.numel)
    assert [(j.lo, j.hi) for j in jobs] == [(0, SLICE), (SLICE, 2 * SLICE), (2 * SLICE, 3 * SLICE)]  # the tail: nothing
    tokens = [lane.issue(j) for j in jobs[:2]]  # two in flight, as the scheduler runs it
    lane.finish(tokens[0])
    tokens.append(lane.issue(jobs[2]))
    for t in tokens[1:]:
        lane.finish(t)
    CpuAdamKernel().step(want.state, want.grad, None if want.master_is_param else want.param, segments, hypers, 3, 2.5)
    for k in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.state[k], want.state[k], rtol=1e-6, atol=1e-7, msg=k)
    assert torch.equal(ours.param, ours.master.to(dtype))  # also in the gap and the tail, left alone


# ----------------------------------------------------------------- the scheduler alone


class _Job:
    def __init__(self, index: int, n: int) -> None:
        self.index, self.numel, self.by = index, n, []


class _Lane:
    """Runs a job when it is finished (in flight until then), ``depth`` at a time."""

    depth = 2

    def __init__(self, gate: threading.Event | None = None, fail: int | None = None) -> None:
        self.gate, self.fail, self.in_flight, self.most = gate, fail, 0, 0

    def issue(self, job):
        if job.index == self.fail:
            raise ValueError(f"lane failed on chunk {job.index}")
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        return job

    def finish(self, job):
        if self.gate is not None:
            self.gate.wait()
        job.by.append("device")
        self.in_flight -= 1


def test_scheduler_runs_every_slice_once_from_both_ends():
    lane = _Lane()
    updates = HostUpdates(StatsCounter(), lane)
    jobs = [_Job(c, 10) for c in range(4) for _ in range(25)]
    updates.submit(jobs, lambda job: job.by.append("cpu"))
    updates.wait_all()
    assert all(len(j.by) == 1 for j in jobs)
    assert jobs[0].by == ["cpu"] and jobs[-1].by == ["device"]  # each lane starts at its end
    cpu = [i for i, j in enumerate(jobs) if j.by == ["cpu"]]
    assert cpu == list(range(len(cpu)))  # the CPU took a prefix, the lane the rest
    stats = updates.stats.now
    assert stats.cpu_update_s > 0 and stats.update_wait_s >= 0
    assert (stats.updated_cpu, stats.updated_device) == (10 * len(cpu), 10 * (len(jobs) - len(cpu)))
    assert lane.most <= lane.depth


def test_trace_records_each_slice_and_wait():
    updates = HostUpdates(StatsCounter(), _Lane())
    updates.trace = []
    jobs = [_Job(c, 10) for c in range(3) for _ in range(4)]
    updates.submit(jobs, lambda job: job.by.append("cpu"))
    updates.wait(2)
    updates.wait_all()
    slices = [r for r in updates.trace if r[0] != "wait"]
    assert sorted((r[0], r[1], r[4]) for r in slices) == sorted((j.by[0], j.index, 10) for j in jobs)
    assert all(r[2] <= r[3] for r in updates.trace)
    assert [r[1] for r in updates.trace if r[0] == "wait"] == [2, 0, 1]


def test_a_chunk_waits_for_both_lanes_and_errors_reach_the_waiter():
    gate = threading.Event()
    updates = HostUpdates(StatsCounter(), _Lane(gate))
    jobs = [_Job(0, 1), _Job(0, 1)]  # chunk 0: one slice per lane
    updates.submit(jobs, lambda job: job.by.append("cpu"))
    assert updates.pending(0)
    threading.Timer(0.2, gate.set).start()
    updates.wait(0)  # returns only once the lane's slice is finished too
    assert [j.by for j in jobs] == [["cpu"], ["device"]] and not updates.pending(0)

    updates = HostUpdates(StatsCounter(), _Lane(fail=1))
    updates.submit([_Job(0, 1), _Job(1, 1)], lambda job: None)
    updates.wait(0)
    with pytest.raises(ValueError, match="lane failed on chunk 1"):
        updates.wait(1)
