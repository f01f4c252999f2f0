"""``build_arenas``: what each placement allocates (the search's ``ArenaBytes`` counts exactly that),
and what a gather reads: trainable shards on the device in mixed precision keep no compute-dtype
copy, their gathers cast the fp32 master; frozen shards and offloaded ones keep theirs. The fill
runs on the rank's share of the cores; host arenas are on huge pages ([Note: huge pages])."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from elixir_runtime.adam_state import ADAM_STATE, MOMENTS
from elixir_runtime.chunk.host_memory import empty_arena
from elixir_runtime.chunk.layout import build_layout
from elixir_runtime.chunk.store import build_arenas
from elixir_runtime.search.memory import ArenaBytes

SIZES = [100, 37, 64, 210, 5, 90]
GROUPS = [0, -1, 0, 1, -1, 0]  # -1: frozen


def _case(world_size: int, alignment: int = 8):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n) / 3) for n in SIZES]
    layout = build_layout(
        params,
        [[f"p{i}"] for i in range(len(SIZES))],
        GROUPS,
        [False] * len(SIZES),
        world_size=world_size,
        chunk_size=16 * alignment,
        alignment=alignment,
    )
    return layout, params


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world_size", [1, 2])
def test_arena_bytes_match_the_allocation_per_placement(dtype: torch.dtype, world_size: int, moments: str) -> None:
    state = ADAM_STATE[moments]
    layout, _ = _case(world_size, state.alignment)
    n = len(layout.chunks)
    placement = ["device" if c % 2 else "host" for c in range(n)]
    arenas = build_arenas(layout, placement, 0, torch.device("cpu"), dtype, state)
    on_device = np.array([p == "device" for p in placement])
    mem = ArenaBytes(layout, dtype, state)
    # without a window every gradient shard of the device counts; they are allocated per chunk later
    grads = mem.grads(on_device)
    assert grads == sum(
        layout.shard_numel(c) * _bytes(torch.empty(1, dtype=dtype))
        for c in layout.chunks
        if c.trainable and on_device[c.index]
    )
    for where, counted in (("device", mem.device(0, on_device) - mem.private - grads), ("host", mem.host(on_device))):
        a = arenas[where]
        tensors = [a.param, a.grad] + [t for s, t in a.state.items() if s.moment or not a.master_is_param]
        assert sum(_bytes(t) for t in tensors) == counted, where
    device = arenas["device"]
    assert device.grad.numel() == 0
    trainable_on_device = sum(layout.shard_numel(c) for c in layout.chunks if c.trainable and on_device[c.index])
    frozen_on_device = sum(layout.shard_numel(c) for c in layout.chunks if not c.trainable and on_device[c.index])
    if dtype == torch.float32:  # the master is the param
        assert device.param.numel() == trainable_on_device + frozen_on_device
    else:  # no compute-dtype copy of the trainable shards on the device
        assert device.cast_on_gather and device.param_copy is None
        assert device.param.numel() == frozen_on_device
        assert arenas["host"].param_copy is not None


@pytest.mark.parametrize("world_size", [1, 2])
def test_gathers_read_bf16_of_the_master_or_the_frozen_copy(world_size: int) -> None:
    layout, params = _case(world_size)
    n = len(layout.chunks)
    for placement in (["device"] * n, ["host"] * n, ["device" if c % 2 else "host" for c in range(n)]):
        for rank in range(world_size):
            arenas = build_arenas(layout, placement, rank, torch.device("cpu"), torch.bfloat16, ADAM_STATE["fp32"])
            for c in layout.chunks:
                a = arenas[placement[c.index]]
                size = layout.shard_numel(c)
                got = torch.empty(size, dtype=torch.bfloat16)
                got.copy_(a.source(a.offsets[c.index], size, c.trainable))  # what a gather copies
                full = torch.zeros(c.numel, dtype=torch.bfloat16)
                for s in c.slots:
                    full[s.offset : s.offset + s.numel] = params[s.param].detach().to(torch.bfloat16)
                assert torch.equal(got, full[rank * size : (rank + 1) * size]), (c.index, placement[c.index], rank)


def test_the_fill_runs_on_the_ranks_share_of_the_cores_whatever_torchrun_set(monkeypatch) -> None:
    """torchrun's OMP_NUM_THREADS=1 (here: torch.set_num_threads(1)) does not reach the fill's casts
    and zeroing: 2 ranks on an 8-core host fill on 4 threads each, and the setting is restored."""
    from elixir_runtime import host

    monkeypatch.setattr(host, "usable_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layout, params = _case(1)
    seen: list[int] = []

    def weights(p: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return p.detach().reshape(-1)[start : start + numel]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arenas = build_arenas(
            layout, ["host"] * len(layout.chunks), 0, torch.device("cpu"), torch.bfloat16, ADAM_STATE["fp32"], weights
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {4}
    a = arenas["host"]
    for c in layout.chunks:
        for s in c.slots:
            off = a.offsets[c.index] + s.offset
            target = a.master if c.trainable else a.param
            assert torch.equal(target[off : off + s.numel], params[s.param].detach().to(target.dtype))


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(t: torch.Tensor) -> list[set[str]]:
    """The ``VmFlags`` of each mapping that overlaps ``t``'s whole pages (``/proc/self/smaps``)."""
    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("VmFlags:"):
            flags.append(set(line.split()[1:]))
    return flags


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no transparent huge pages"
)
def test_an_arena_is_advised_onto_huge_pages_where_the_kernel_offers_them() -> None:
    """Its whole pages are advised ``MADV_HUGEPAGE`` (``hg``). How many the kernel backs with huge pages
    at the first touch depends on the host's free, unfragmented memory: not this test's to assert."""
    t = empty_arena(64 * 2**20 // 4, torch.float32)  # 64 MiB
    flags = _vm_flags(t)
    assert flags and all("hg" in f for f in flags), flags
    assert not any("hg" in f for f in _vm_flags(torch.empty(64 * 2**20 // 4)))  # a plain tensor is not advised
    t.zero_()  # the first touch, as the fill's
    assert torch.count_nonzero(t) == 0
