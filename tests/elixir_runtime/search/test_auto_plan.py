"""``mode="auto"``'s planning step as ``prepare`` runs it, with the GPU's budget and hardware faked.

``prepare`` takes this path only on CUDA; here its two machine-facing inputs (free GPU memory,
hardware profile) are replaced, and the plan is then run by the engine on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from search_cases import GIB, gpu_host, model_state_bytes

import elixir_runtime as er
import elixir_runtime.planner as planner
from elixir_runtime.adam_state import ADAM_STATE
from elixir_runtime.distributed.collectives import Collectives
from elixir_runtime.gpu_limit import limit_gpu_memory
from elixir_runtime.search import Budget
from elixir_runtime.search.memory import ArenaBytes
from elixir_runtime.units import find_units, param_table
from helpers.dist import run_distributed
from helpers.fake_cuda import FakeGPU
from helpers.models import make_batch, tiny_gpt2


@pytest.fixture(autouse=True)
def _cache_in(tmp_path, monkeypatch) -> None:
    """Elixir's caches in the test's folder, not the user's ``~/.cache/elixir`` (the ranks inherit it)."""
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))


def _fake_machine(monkeypatch, model, share: float) -> None:
    states = model_state_bytes(model)

    def budget(device, activations, buffers, host):
        return Budget(
            int(1.25 * activations) + buffers + int(share * states), activations, buffers, 64 * GIB, host.ranks
        )

    monkeypatch.setattr(planner, "device_budget", budget)
    monkeypatch.setattr(planner, "job_hardware", lambda coll, device, cpu_threads=None, state=None: gpu_host())


def _model():
    model = tiny_gpt2(n_layer=4, n_embd=64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_auto_plan_runs_in_the_engine(monkeypatch) -> None:
    model = _model()
    _fake_machine(monkeypatch, model, share=0.3)
    batch = make_batch(128)
    units = find_units(model, None)
    config = er.ElixirConfig()
    planned = planner.search_job(
        planner.PlanJob(model, units, batch, config, torch.device("cpu"), torch.float32, Collectives(None))
    )
    searched = planned.plan
    assert {id(p) for p in planned.live.param_table.params} == {id(p) for p in model.parameters()} and searched.offload
    assert any("hardware: test GPU" in n for n in searched.search.notes)

    static = er.ElixirConfig(
        mode="static", chunk_size=searched.chunk_size, n_blocks=searched.n_blocks, offload=searched.offload
    )
    model, opt = er.prepare(model, torch.optim.AdamW(model.parameters()), config=static, example_batch=batch)
    plan = model._elixir.plan
    assert (plan.n_chunks, plan.chunk_size, plan.offload) == (searched.n_chunks, searched.chunk_size, searched.offload)
    # a static plan has no profile, so no gradient window: every GPU gradient shard counts
    windowed = ArenaBytes(
        model._elixir.runtime.layout, torch.float32, ADAM_STATE["fp32"], window=planned.live.grad_window
    )
    on_device = np.array([s == "device" for s in plan.placement()])
    assert plan.host_bytes == searched.host_bytes
    assert plan.device_bytes - plan.memory.device_grads == searched.device_bytes - windowed.grads(on_device)
    for _ in range(2):
        opt.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()


def test_without_a_batch_the_activations_get_a_fixed_share(monkeypatch) -> None:
    model = _model()
    _fake_machine(monkeypatch, model, share=3.0)
    units = find_units(model, None)
    planned = planner.search_job(
        planner.PlanJob(model, units, None, er.ElixirConfig(), torch.device("cpu"), torch.float32, Collectives(None))
    )
    plan = planned.plan
    assert planned.live.param_table.params == param_table(model, units, [u.index for u in units]).params
    assert plan.budget.activations == int(planner.UNPROFILED_ACTIVATION_SHARE * plan.budget.capacity / 1.25)


def test_clips_grads_reaches_the_search(monkeypatch) -> None:
    """``ElixirConfig.clips_grads`` decides when the predicted CPU updates start; fp16 always
    syncs, and so does the non-finite check (``skip_nonfinite``, on by default)."""
    model = _model()
    _fake_machine(monkeypatch, model, share=0.3)
    seen = []
    real = planner.search

    def spy(table, profile, hardware, budget, settings, **kwargs):
        if settings.config.moments == "fp32":  # not the 8-bit search the planner prices beside it
            seen.append(settings.clips_grads)
        return real(table, profile, hardware, budget, settings, **kwargs)

    monkeypatch.setattr(planner, "search", spy)
    units = find_units(model, None)
    batch = make_batch(128)
    cpu, coll = torch.device("cpu"), Collectives(None)
    for clips, dtype in (
        (True, torch.float32),
        (False, torch.float32),
        (False, torch.bfloat16),
        (False, torch.float16),
    ):
        planner.search_job(
            planner.PlanJob(
                model, units, batch, er.ElixirConfig(clips_grads=clips, skip_nonfinite=False), cpu, dtype, coll
            )
        )
    planner.search_job(
        planner.PlanJob(model, units, batch, er.ElixirConfig(clips_grads=False), cpu, torch.bfloat16, coll)
    )
    assert seen == [True, False, False, True, True]


def _plan_on_two_ranks(rank: int, world: int) -> tuple:
    model = _model()
    states = model_state_bytes(model)
    planner.device_budget = lambda device, act, buffers, host: Budget(
        int(1.25 * act) + buffers + int(0.3 * states), act, buffers, 64 * GIB, host.ranks
    )
    planner.job_hardware = lambda coll, device, cpu_threads=None, state=None: gpu_host(gpus=2)
    seen, real = [], planner.search

    def spy(table, profile, hardware, budget, settings, **kwargs):
        if settings.config.moments == "fp32":  # not the 8-bit search the planner prices beside it
            seen.append(settings.busbw)
        return real(table, profile, hardware, budget, settings, **kwargs)

    planner.search = spy
    units = find_units(model, None)
    coll = Collectives(torch.distributed.group.WORLD)
    planned = planner.search_job(
        planner.PlanJob(model, units, make_batch(128), er.ElixirConfig(), torch.device("cpu"), torch.float32, coll)
    )
    p, live = planned.plan, planned.live
    # rank 0 keeps the layout its search built, rank 1 builds it from the chunk size: the same layout
    decided = (
        [n[0] for n in live.param_table.names],
        p.chunk_size,
        p.offload,
        p.n_blocks,
        live.layout.fingerprint(),
        p.to_dict(),
    )
    return decided, seen, p.search.notes


def test_ranks_time_their_own_collectives_and_agree_on_the_plan() -> None:
    """Every rank times the engine's all-gather + reduce-scatter on the job's group; rank 0 plans
    with that bandwidth (not the profile's peer-copy proxy) and every rank gets its plan."""
    (plan0, seen0, notes), (plan1, seen1, _) = run_distributed(_plan_on_two_ranks, 2, timeout=240)
    assert plan0 == plan1
    assert len(seen0) == 1 and seen0[0] > 0 and seen1 == []
    assert any("measured on the job's process group" in n for n in notes)


def test_the_gpu_limit_shrinks_the_plan(monkeypatch) -> None:
    """``prepare``'s order on a GPU: ``limit_gpu_memory`` lowers the allocator's fraction, then the
    budget reads it back; a cap and the same fraction set by the user give the same plan. Without
    an example batch (a structural profile: fast), activations take a fixed share of the capacity."""
    model = _model()
    monkeypatch.setattr(planner, "job_hardware", lambda coll, device, cpu_threads=None, state=None: gpu_host())
    gpu = FakeGPU(total=64 * GIB).install(monkeypatch)
    coll = Collectives(None)

    def plan(gpu_memory=None, model=model):
        config = er.ElixirConfig(gpu_memory=gpu_memory)
        limit_gpu_memory(torch.device("cuda", 0), config.gpu_memory)
        return planner.search_job(
            planner.PlanJob(model, find_units(model, None), None, config, torch.device("cpu"), torch.float32, coll)
        ).plan

    whole = plan()
    assert whole.budget.limit is None and not whole.offload
    cap = model_state_bytes(model)  # U_allowed is 57 % of it
    capped = plan(cap)
    assert (capped.budget.capacity, capped.budget.limit) == (cap, cap) and gpu.fraction == cap / gpu.total
    assert capped.offload and capped.device_bytes <= capped.budget.allowed < whole.device_bytes

    gpu.fraction = 1.0
    torch.cuda.set_per_process_memory_fraction(cap / gpu.total)  # the user's own limit, no cap
    by_fraction = plan()
    assert by_fraction.budget.limit == int(cap / gpu.total * gpu.total)
    same = lambda r: (r.chunk_size, r.n_blocks, r.offload)  # noqa: E731
    assert same(by_fraction) == same(capped)

    gpu.fraction = 1.0
    wide = tiny_gpt2(n_layer=1, n_embd=512)  # a 512 x 2048 matrix: 4 MiB in one chunk
    with pytest.raises(
        er.PlanError, match=r"no plan fits(.|\n)*capped at 4.00 MiB per process \(ElixirConfig.gpu_memory"
    ):
        plan("4MiB", model=wide)
