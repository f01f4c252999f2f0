"""``ElixirConfig.gpu_memory`` and torch's per-process memory fraction: parsing, the limit the
allocator is given, and the capacity the planner reads back (GPU faked: ``helpers/fake_cuda.py``)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.config import ConfigError, parse_size
from elixir_runtime.gpu_limit import device_capacity, limit_gpu_memory, process_limit
from elixir_runtime.host import HostMemory
from elixir_runtime.plan_view import plan_table
from elixir_runtime.planner import device_budget
from helpers.fake_cuda import GIB, FakeGPU
from helpers.logs import captured
from helpers.models import make_batch, tiny_gpt2

GPU = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("70GiB", 70 * GIB),
        ("70G", 70 * GIB),
        ("70GB", 70 * 10**9),
        ("512MiB", 512 * 2**20),
        ("70", 70 * GIB),
        (" 1.5 TiB ", int(1.5 * 2**40)),
        (85017493504, 85017493504),
        (None, None),
    ],
)
def test_gpu_memory_is_stored_in_bytes(value, expected) -> None:
    assert er.ElixirConfig(gpu_memory=value).gpu_memory == expected


@pytest.mark.parametrize(
    "value, match",
    [
        (-5, r"gpu_memory must be at least 1 MiB, got -5 bytes; give a size such as '70GiB'"),
        (0, r"gpu_memory must be at least 1 MiB, got 0 bytes"),
        (80, r"at least 1 MiB, got 80 bytes; give a size such as '70GiB' \(binary\) or '70GB' \(decimal\)"),
        ("0GiB", r"at least 1 MiB, got 0 bytes"),
        ("-1GiB", r"gpu_memory: not a memory size: '-1GiB'"),
        ("70 gigs", r"gpu_memory: not a memory size: '70 gigs'"),
        (7.5e10, r"gpu_memory must be a size such as '70GiB' or '70GB', an int of bytes, or None.*float"),
        (True, r"gpu_memory must be a size.*bool"),
    ],
)
def test_bad_gpu_memory_names_the_field_and_the_fix(value, match) -> None:
    with pytest.raises(ConfigError, match=match):
        er.ElixirConfig(gpu_memory=value)


def test_parse_size_is_one_rule() -> None:
    assert parse_size("80GiB") == 80 * GIB == parse_size("80g") and parse_size("80GB") == 80 * 10**9
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("GiB")


def test_the_cap_becomes_the_allocators_limit_and_the_budgets(monkeypatch) -> None:
    gpu = FakeGPU(total=80 * GIB, used_elsewhere=GIB, allocated=2 * GIB, reserved=3 * GIB).install(monkeypatch)
    assert process_limit(GPU) is None
    assert device_capacity(GPU) == 80 * GIB - GIB - 3 * GIB + (3 * GIB - 2 * GIB)  # free + cached
    limit_gpu_memory(GPU, None)
    assert (gpu.fraction, gpu.set_calls) == (1.0, 0)

    limit_gpu_memory(GPU, 40 * GIB)
    assert gpu.fraction == 0.5 and process_limit(GPU) == 40 * GIB
    assert device_capacity(GPU) == 38 * GIB  # the limit less what is allocated now
    budget = device_budget(GPU, activations=GIB, buffers=0, host=HostMemory(64 * GIB))
    assert (budget.capacity, budget.limit) == (38 * GIB, 40 * GIB)
    assert budget.to_dict()["limit"] == 40 * GIB


def test_a_smaller_fraction_the_user_set_stays(monkeypatch) -> None:
    gpu = FakeGPU(total=80 * GIB).install(monkeypatch)
    torch.cuda.set_per_process_memory_fraction(0.25, GPU)  # the user's, before prepare
    limit_gpu_memory(GPU, 40 * GIB)
    assert (gpu.fraction, gpu.set_calls) == (0.25, 1)
    assert process_limit(GPU) == 20 * GIB == device_budget(GPU, 0, 0, HostMemory(64 * GIB)).capacity
    gpu.fraction = 0.75  # a larger one is lowered to the cap
    limit_gpu_memory(GPU, 40 * GIB)
    assert gpu.fraction == 0.5


def test_a_fraction_alone_limits_the_budget(monkeypatch) -> None:
    FakeGPU(total=80 * GIB, used_elsewhere=GIB).install(monkeypatch)
    assert device_budget(GPU, 0, 0, HostMemory(64 * GIB)).capacity == 79 * GIB
    torch.cuda.set_per_process_memory_fraction(0.5, GPU)
    assert device_budget(GPU, 0, 0, HostMemory(64 * GIB)).capacity == 40 * GIB


def test_a_cap_larger_than_the_card_is_refused(monkeypatch) -> None:
    gpu = FakeGPU(total=80 * GIB).install(monkeypatch)
    with pytest.raises(
        ConfigError,
        match=r"gpu_memory is 90.00 GiB .*more than the 80.00 GiB of cuda:0 \(Fake GPU\): "
        r"use at most 85899345920 bytes, or None",
    ):
        limit_gpu_memory(GPU, 90 * GIB)
    assert gpu.set_calls == 0
    limit_gpu_memory(GPU, 80 * GIB)  # the whole card: nothing to lower
    assert gpu.fraction == 1.0


def test_prepare_records_the_cap_and_says_it_is_ignored_on_a_cpu(caplog) -> None:
    model = tiny_gpt2()
    config = er.ElixirConfig(mode="static", gpu_memory="1GiB")
    with captured(caplog, logging.WARNING, "elixir_runtime.api"):
        model, _ = er.prepare(model, torch.optim.AdamW(model.parameters()), config=config)
    plan = model._elixir.plan
    assert plan.gpu_memory == GIB and json.loads(plan.to_json())["gpu_memory"] == GIB
    assert re.search(r"GPU memory cap +1.000 GiB per GPU \(ElixirConfig.gpu_memory\)", plan_table(plan))
    assert "gpu_memory=1073741824 bytes is ignored: this run computes on cpu" in caplog.text


@pytest.mark.gpu
def test_prepare_on_a_gpu_holds_the_allocator_to_the_cap() -> None:
    """The real thing: ``prepare`` lowers the fraction, the plan is made within the cap, and an
    allocation past it fails with torch's out-of-memory error naming the allowed bytes."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()  # a block cached by an earlier test would serve the allocation below, unchecked
    before, total = torch.cuda.get_per_process_memory_fraction(device), torch.cuda.mem_get_info(device)[1]
    cap = 4 * GIB
    try:
        model = tiny_gpt2()
        model, _ = er.prepare(
            model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(gpu_memory=cap), example_batch=make_batch(128)
        )
        assert torch.cuda.get_per_process_memory_fraction(device) == pytest.approx(cap / total)
        plan = model._elixir.plan
        assert plan.gpu_memory == cap and plan.budget.limit <= cap and plan.budget.capacity <= cap
        with pytest.raises(torch.OutOfMemoryError, match="allowed"):
            torch.empty(cap, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def test_expandable_segments_follow_the_users_allocator_settings(monkeypatch) -> None:
    """The user's PYTORCH_CUDA_ALLOC_CONF decides; otherwise they are turned on (a setter call)."""
    from elixir_runtime import gpu_limit

    calls = []
    monkeypatch.setattr(gpu_limit.torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    assert gpu_limit.expandable_segments() is False and calls == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert gpu_limit.expandable_segments() is True and calls == []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert gpu_limit.expandable_segments() is True and calls == ["expandable_segments:True"]
