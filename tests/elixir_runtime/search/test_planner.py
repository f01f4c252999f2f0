"""The planner decides a plan once: ``prepare`` installs the plan it returns, a searched plan
keeps the layout the search built, and a plan to follow is checked against the model before the
engine allocates anything."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from search_cases import GIB, gpu_host, model_state_bytes

import elixir_runtime as er
import elixir_runtime.planner as planner
from elixir_runtime.chunk.store import ShardArenas
from elixir_runtime.config import PlanMismatch
from elixir_runtime.distributed.collectives import Collectives
from elixir_runtime.profiler.trace import trace_unit_order
from elixir_runtime.search import Budget
from elixir_runtime.units import find_units
from helpers.models import make_batch, read_head_outside, tiny_gpt2, tiny_llama


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """Two param groups (no decay on biases), so the layout orders each chunk by group."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])


def test_prepare_installs_the_plan_the_planner_makes() -> None:
    model, batch = tiny_gpt2(n_layer=3, n_embd=64), make_batch(64)
    config = er.ElixirConfig(mode="static", n_blocks="min", offload=0.5, chunk_size=20_000)
    twin = copy.deepcopy(model)
    opt = _optimizer(twin)
    groups = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    cpu, units = torch.device("cpu"), find_units(twin, None)
    job = planner.PlanJob(twin, units, batch, config, cpu, torch.float32, param_group=lambda p: groups[id(p)])
    planned = planner.plan_job(job)

    model, _ = er.prepare(model, _optimizer(model), config, example_batch=batch)
    installed, live = model._elixir.plan, model._elixir.live
    assert installed == planned.plan and installed.offload
    assert live.layout.fingerprint() == planned.live.layout.fingerprint()
    assert live.unit_chunks == planned.live.unit_chunks
    assert model._elixir.runtime.layout is live.layout  # the runtime runs the plan's layout, not a rebuilt one
    with pytest.raises(dataclasses.FrozenInstanceError):
        installed.n_blocks = 1  # built once: a variant is dataclasses.replace of it


def test_one_job_one_plan_by_either_entry() -> None:
    """A ``PlanJob`` is frozen (a variant is ``dataclasses.replace`` of it), and ``plan_job`` on the CPU
    decides what ``plan_static`` does for the use order traced there: the job, not the entry, decides."""
    model, batch = tiny_gpt2(n_layer=3, n_embd=64), make_batch(64)
    config = er.ElixirConfig(mode="static", n_blocks="min", offload=0.5, chunk_size=20_000)
    cpu = torch.device("cpu")
    job = planner.PlanJob(model, find_units(model, None), batch, config, cpu, torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.config = er.ElixirConfig()  # type: ignore[misc]
    order, outside = trace_unit_order(model, job.units, batch, torch.float32, cpu)
    by_job, by_order = planner.plan_job(job), planner.plan_static(job, order, outside)
    assert by_job.plan == by_order.plan and by_job.plan.offload and by_job.plan.batch_shape == (2, 16)
    assert by_job.live.layout.fingerprint() == by_order.live.layout.fingerprint()
    other = planner.plan_job(dataclasses.replace(job, config=dataclasses.replace(config, offload=0.0)))
    assert not other.plan.offload and job.config.offload == 0.5


def _search_on_cpu(model: torch.nn.Module, batch: dict) -> planner.Planned:
    """``--elixir auto``'s decision (``planner.search_job``) for one rank, the CPU standing for its GPU."""
    units = find_units(model, None)
    return planner.search_job(
        planner.PlanJob(model, units, batch, er.ElixirConfig(), torch.device("cpu"), torch.float32, Collectives(None))
    )


def test_a_searched_plan_carries_the_layout_the_search_built(monkeypatch) -> None:
    model = tiny_gpt2(n_layer=4, n_embd=64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    states = model_state_bytes(model)
    monkeypatch.setattr(
        planner,
        "device_budget",
        lambda device, act, buffers, host: Budget(
            int(1.25 * act) + buffers + int(0.3 * states), act, buffers, 64 * GIB, host.ranks
        ),
    )
    monkeypatch.setattr(planner, "job_hardware", lambda coll, device, cpu_threads=None, state=None: gpu_host())
    results = []
    real = planner.search

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[4].config.moments == "fp32":  # not the 8-bit search the planner prices beside it
            results.append(result)
        return result

    monkeypatch.setattr(planner, "search", spy)
    planned = _search_on_cpu(model, make_batch(128))
    plan = planned.plan
    assert len(results) == 1 and planned.live.layout is results[0].layout and plan.offload
    assert (plan.chunk_size, plan.n_blocks, list(plan.offload)) == (
        results[0].chunk_size,
        results[0].placement.n_blocks,
        results[0].placement.offload,
    )
    again = er.ElixirPlan.from_json(plan.to_json())
    assert again == plan and again.predicted == plan.predicted and again.budget == plan.budget
    assert again.search == plan.search and again.profile == plan.profile and again.chunks == plan.chunks


@pytest.mark.parametrize("own", [True, False], ids=["own-profile", "profile-file"])
def test_a_job_prices_its_gemms_at_their_shapes_timed_on_its_device(monkeypatch, tmp_path, own: bool) -> None:
    """With this machine's own profile the job times the profiled step's GEMM shapes before the
    search, which prices them so, and caches them; a profile file is planned with as it is."""
    from elixir_runtime.hardware.load import ENV_HARDWARE
    from elixir_runtime.hardware.profile import gemm_shape

    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    if own:
        monkeypatch.delenv(ENV_HARDWARE, raising=False)
    else:
        monkeypatch.setenv(ENV_HARDWARE, str(tmp_path / "given.json"))
    monkeypatch.setattr(
        planner,
        "device_budget",
        lambda device, act, buffers, host: Budget(64 * GIB, act, buffers, 64 * GIB, host.ranks),
    )
    monkeypatch.setattr(
        planner,
        "job_hardware",
        lambda coll, device, cpu_threads=None, state=None: dataclasses.replace(gpu_host(), dtype="float32"),
    )
    profiles = []
    real = planner.search
    monkeypatch.setattr(
        planner, "search", lambda table, profile, *a, **kw: profiles.append(profile) or real(table, profile, *a, **kw)
    )
    plan = _search_on_cpu(tiny_llama(n_layer=2, n_embd=64), make_batch(128)).plan
    shapes = {c for c in profiles[0].flop_classes if gemm_shape(c)}
    assert shapes  # the step's own GEMMs, by shape
    timed = plan.search.hardware.gemms
    assert (set(timed) == shapes) if own else not timed
    assert all(r > 0 for r in timed.values())
    said = [n for n in plan.search.notes if n.startswith("GEMMs:")]
    assert said == ([f"GEMMs: {len(shapes)} shapes of this step at their rates timed on this GPU"] if own else [])


@pytest.mark.parametrize("named", [True, False], ids=["named", "found-by-the-profile"])
def test_the_search_plans_the_resident_chunk(monkeypatch, named: bool) -> None:
    """A head read outside its module (``tests/elixir_runtime/runtime/test_resident.py``) under
    ``mode="auto"``, named in ``prepare(..., resident=...)`` or found by the profile: the search (GPU
    budget and hardware faked) builds its layouts with the head in a private chunk, which the plan has
    the root acquire and counts."""
    monkeypatch.setattr(
        planner, "device_budget", lambda device, act, buffers, host: Budget(GIB, act, buffers, GIB, host.ranks)
    )
    monkeypatch.setattr(planner, "job_hardware", lambda coll, device, cpu_threads=None, state=None: gpu_host())
    model = tiny_llama()
    head = read_head_outside(model)
    units, cpu = find_units(model, None), torch.device("cpu")
    resident = (head,) if named else ()
    job = planner.PlanJob(model, units, make_batch(128), er.ElixirConfig(), cpu, torch.float32, resident=resident)
    planned = planner.search_job(job)
    plan, live = planned.plan, planned.live
    i = live.param_table.index[id(head)]
    assert live.param_table.resident[i] and plan.predicted is not None
    assert live.root_chunks == (live.layout.param_chunk[i],) and live.layout.chunks[live.root_chunks[0]].private
    assert plan.memory.private == head.numel() * 4


def test_a_plan_to_follow_is_checked_before_any_engine_memory(monkeypatch) -> None:
    """``prepare(..., plan=...)`` (a plan file): the plan's layout is checked against the model's
    before the chunk store allocates a byte; the plan of this model is followed, another model's
    refused with no arena built."""
    events: list[str] = []
    check, allocate = planner._check_follows, ShardArenas.__init__

    def checked(given, planned):
        events.append("check")
        check(given, planned)

    def allocated(self, *args, **kwargs):
        events.append("arenas")
        allocate(self, *args, **kwargs)

    monkeypatch.setattr(planner, "_check_follows", checked)
    monkeypatch.setattr(ShardArenas, "__init__", allocated)
    batch = make_batch(64)
    config = er.ElixirConfig(mode="static", n_blocks="min", offload=0.5, chunk_size=20_000)
    model = tiny_gpt2(n_layer=3, n_embd=64)
    model, _ = er.prepare(model, _optimizer(model), config, batch)
    saved = er.ElixirPlan.from_json(model._elixir.plan.to_json())
    assert "check" not in events  # nothing to follow

    events.clear()
    same = tiny_gpt2(n_layer=3, n_embd=64)
    same, _ = er.prepare(same, _optimizer(same), example_batch=batch, plan=saved)
    assert events[0] == "check" and "arenas" in events
    assert same._elixir.plan == saved  # followed: the same plan, decided again for this model

    events.clear()
    other = tiny_gpt2(n_layer=5, n_embd=64)
    with pytest.raises(PlanMismatch, match="does not fit this model: it describes"):
        er.prepare(other, _optimizer(other), example_batch=batch, plan=saved)
    assert events == ["check"] and not hasattr(other, "_elixir")
