"""Host memory as the run will have it (``host.py``, [Note: host memory as the run will have it]):
what the model's own tensors hold is counted once, anonymous memory only; ``prepare`` lets it go as
the chunks fill; and the plan ``prepare`` makes on a machine is the plan ``elixir-plan --host-mem``
makes for that machine's memory, even where the weights decide between fit and no fit."""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref

import numpy as np
import pytest
import torch

import elixir_runtime as er
import elixir_runtime.planner as planner
from elixir_runtime import host
from elixir_runtime.config import PlanError
from elixir_runtime.distributed.collectives import Collectives
from elixir_runtime.hardware import load_hardware
from elixir_runtime.host import HostMemory, held_bytes, size_text
from elixir_runtime.progress import set_progress_factory
from elixir_runtime.units import find_units
from helpers.fake_cuda import GIB, FakeGPU
from helpers.models import make_batch, tiny_gpt2, tiny_llama

CUDA = torch.device("cuda")
MIB = 2**20


def test_held_bytes_counts_each_storage_once_and_only_anonymous_memory(tmp_path) -> None:
    model = tiny_gpt2(n_embd=32, vocab=128)  # wte and lm_head tied: one storage
    params = list(model.parameters())
    assert held_bytes(model.parameters()) == sum(p.numel() * p.element_size() for p in params)
    weight = model.transformer.wte.weight
    assert held_bytes([weight, model.lm_head.weight, weight[:3], weight.view(-1)]) == weight.nbytes
    assert held_bytes([torch.empty(1000, device="meta")]) == 0
    mapped = np.memmap(tmp_path / "weights.bin", dtype=np.float32, mode="w+", shape=(4096,))
    assert held_bytes([torch.from_numpy(mapped)]) == 0  # page cache: MemAvailable counts it already


def test_prepare_lets_each_weight_go_as_its_chunk_fills() -> None:
    """The model's own storages are freed while the shards fill (not after), and nothing the user
    holds (the model, the optimizer and its param list) keeps them alive after ``prepare``."""
    model, batch = tiny_gpt2(n_layer=3, n_embd=64), make_batch(128)
    refs = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters())
    alive: list[int] = []

    class Bar:
        def __init__(self, total, desc, unit) -> None:
            self.filling = desc.startswith("elixir: filling")

        def update(self, n: int = 1) -> None:
            if self.filling:
                gc.collect()
                alive.append(sum(r() is not None for r in refs))

        def close(self) -> None:
            pass

    previous = set_progress_factory(Bar)
    try:
        config = er.ElixirConfig(mode="static", chunk_size=20_000, offload=0.5)
        model, optimizer = er.prepare(model, optimizer, config, example_batch=batch)
    finally:
        set_progress_factory(previous)
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(alive) == model._elixir.plan.n_chunks > 2
    assert alive == sorted(alive, reverse=True) and alive[0] < len(refs) and alive[-1] == 0


# --------------------------------------------------------------------------- plan_job vs elixir-plan


def _machine(monkeypatch, gpu: int, available: int) -> None:
    """A GPU of ``gpu`` free bytes (``FakeGPU``), the shipped H100's rates, ``MemAvailable`` of
    ``available`` bytes (the one place ``/proc/meminfo`` is read)."""
    FakeGPU(total=gpu + GIB, used_elsewhere=GIB).install(monkeypatch)
    monkeypatch.setenv("ELIXIR_HARDWARE", "h100")
    monkeypatch.setattr(host, "_meminfo", lambda field: available)


def _case():
    model = tiny_llama(n_layer=2, n_embd=128, vocab=512).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # everything offloaded: the host memory it needs is fixed, so the host alone decides the fit
    config = er.ElixirConfig(dtype="bf16", offload=1.0, device_assisted_update=False)
    return model, make_batch(512, batch=2, seq=32), config


def _plan_model(model, batch, config, gpu: int, host_mem: int) -> er.ElixirPlan:
    """What ``elixir-plan --gpu-mem <gpu> --host-mem <host_mem> --hardware h100`` decides
    (``plan_report._target``)."""

    def budget(profile):
        return planner.Budget(gpu, profile.activation_peak, profile.buffer_bytes, host_mem, 1)

    target = planner.Target(1, load_hardware("h100"), budget)
    return planner.plan_model(_job(model, batch, config), target).plan


def _job(model, batch, config) -> planner.PlanJob:
    return planner.PlanJob(model, find_units(model, None), batch, config, CUDA, torch.bfloat16, Collectives(None))


def _plan_job(model, batch, config) -> er.ElixirPlan:
    return planner.plan_job(_job(model, batch, config)).plan


def test_the_machine_plans_as_elixir_plan_for_its_memory_with_the_weights_deciding(monkeypatch) -> None:
    model, batch, config = _case()
    gpu = 64 * MIB
    need = _plan_model(model, batch, config, gpu, 64 * GIB).host_bytes  # pinned bytes of the all-offloaded plan
    released = held_bytes([*model.parameters(), *model.buffers(), *batch.values()])
    weights = held_bytes(model.parameters())
    assert weights > 0.1 * need  # the weights are a real share of what the plan needs
    # MemAvailable with the weights loaded: short of the plan by half the weights
    available = math.ceil(need / 0.95) - weights // 2
    with pytest.raises(PlanError, match="no plan fits"):
        _plan_model(model, batch, config, gpu, available)

    _machine(monkeypatch, gpu, available)
    on_machine = _plan_job(model, batch, config)
    assert on_machine.budget.host_capacity == available + released
    assert on_machine.budget.host_released == released
    for_it = _plan_model(model, batch, config, gpu, available + released)  # elixir-plan --host-mem <its RAM>
    mine, theirs = on_machine.to_dict(), for_it.to_dict()
    for key in ("chunk_size", "n_chunks", "n_blocks", "offload", "device_lane", "memory", "predicted"):
        assert mine[key] == theirs[key], key
    assert dataclasses.replace(on_machine.budget, host_released=0) == for_it.budget
    assert on_machine.offload == tuple(range(on_machine.n_chunks)) and on_machine.host_bytes == need


def test_no_fit_states_the_host_accounting(monkeypatch) -> None:
    """A host that cannot hold the plan even with the weights freed: the error says what is available
    now, what the weights free, the share kept back, what each rank gets and the host to ask for."""
    model, batch, config = _case()
    weights = held_bytes(model.parameters())
    need = _plan_model(model, batch, config, 64 * MIB, 64 * GIB).host_bytes
    _machine(monkeypatch, 64 * MIB, need // 2)
    with pytest.raises(PlanError) as exc:
        _plan_job(model, batch, config)
    text = str(exc.value)
    released = held_bytes([*model.parameters(), *model.buffers(), *batch.values()])
    assert released >= weights
    for words in (
        HostMemory(need // 2, released).accounting(),
        "x 0.95 (the rest kept for the process) / 1 rank(s)",
        f"host RAM of at least {size_text(need / 0.95)} for these 1 rank(s)",
    ):
        assert words in text, (words, text)


def test_check_fits_counts_the_weights_freed() -> None:
    """A static plan (``check_fits``) is held to the same host memory as a searched one."""
    model, batch = tiny_gpt2(n_layer=2, n_embd=64), make_batch(128)
    config = er.ElixirConfig(mode="static", offload=1.0)
    job = planner.PlanJob(model, find_units(model, None), batch, config, torch.device("cpu"), torch.float32)
    plan = planner.plan_job(job).plan
    from elixir_runtime.plan import check_fits

    check_fits(plan, torch.device("cpu"), HostMemory(plan.host_bytes // 2, plan.host_bytes))
    with pytest.raises(PlanError, match=r"available now \+ .* free when taken into chunks"):
        check_fits(plan, torch.device("cpu"), HostMemory(plan.host_bytes // 2, plan.host_bytes // 4))
