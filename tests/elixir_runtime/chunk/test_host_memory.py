"""Host arenas (``chunk/host_memory.py``): allocated untouched and advised onto huge pages ([Note: huge pages])."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from elixir_runtime.chunk.host_memory import empty_arena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``t``'s bytes (``/proc/self/smaps``)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no transparent huge pages"
)
def test_an_arena_is_backed_by_huge_pages_where_the_kernel_offers_them() -> None:
    t = empty_arena(64 * 2**20 // 4, torch.float32)  # 64 MiB
    t.zero_()  # the first touch, as the fill's
    assert _huge_kib(t) >= 32 * 1024  # most of it: the ends may share small pages with other memory
    assert torch.count_nonzero(t) == 0
