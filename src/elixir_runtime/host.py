"""This host: its RAM (``/proc/meminfo``, read in one place), its cores and the ranks sharing them,
and the host memory a job's own tensors hold.

Used by the memory budget of the search, the plan's check against available RAM, the hardware
measurement and the warning about every rank holding its own copy of the weights.

[Note: host memory as the run will have it]
``prepare`` plans while the model's own copy of its weights is still in host memory, and that copy
is freed once the weights are in chunks (``chunk/store.py`` lets each parameter's storage go as its
chunk is filled). So the host memory a plan may use is ``MemAvailable`` now plus what this host's
ranks free then (``HostMemory.released``), counted from the tensors themselves: on the CPU, not
meta, each storage once, and only anonymous memory. Weights that are views of a file mapped into
memory (``from_pretrained`` maps safetensors files and hands out views of them where no conversion
is needed) are page cache, which ``MemAvailable`` already counts as available: they free nothing.
This is the host memory ``elixir-plan --host-mem`` means: what the job has before its model is
loaded (docs/planning.md, "Host memory").
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HostMemory", "core_share", "held_bytes", "host_available", "host_total", "local_ranks", "usable_cores"]

GIB = 2**30


def host_available() -> int:
    """``MemAvailable``: what this host can still give (the model's own weights already counted);
    the physical RAM where ``/proc/meminfo`` is missing."""
    return _meminfo("MemAvailable")


def host_total() -> int:
    """``MemTotal``: the host's RAM."""
    return _meminfo("MemTotal")


def _meminfo(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_ranks() -> int:
    """Ranks sharing this host (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under ``taskset`` or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_share(ranks_per_host: int, cores: int | None = None) -> int:
    """One rank's share of ``cores`` (default ``usable_cores()``) when ``ranks_per_host`` share them.

    The engine's own CPU work takes this share, not ``torch.get_num_threads()``: ``torchrun`` sets
    ``OMP_NUM_THREADS=1`` for every rank, which would leave it to one core.
    """
    return max(1, (cores or usable_cores()) // max(1, ranks_per_host))


@dataclass(frozen=True)
class HostMemory:
    """The host memory a job will have once its weights are in chunks (the Note above)."""

    available: int
    """``MemAvailable`` when the plan is made."""
    released: int = 0
    """What the ranks on this host free when ``prepare`` takes their weights into chunks."""
    ranks: int = 1
    """Ranks sharing this host."""

    @property
    def capacity(self) -> int:
        return self.available + self.released

    def accounting(self) -> str:
        """``99.27 GiB available now + 24.21 GiB the model's weights free = 123.48 GiB``."""
        return accounting(self.available, self.released)


def accounting(available: int, released: int) -> str:
    """The host memory a plan counts, in words: the one phrasing (``HostMemory``, ``Budget``)."""
    if not released:
        return size_text(available)
    return (
        f"{size_text(available)} available now + {size_text(released)} the model's own weights free "
        f"when taken into chunks = {size_text(available + released)}"
    )


def size_text(n: float) -> str:
    """``123.48 GiB``; below a GiB in MiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.2f} MiB"


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Anonymous host memory these tensors hold: on the CPU, not meta, each storage once, none of
    a file mapped into memory (page cache: ``MemAvailable`` counts it already)."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    if not storages:
        return 0
    files = _file_mappings()
    return sum(n for ptr, n in storages.items() if not _inside(files, ptr))


def _file_mappings() -> list[tuple[int, int]]:
    """This process's mappings of regular files (``/proc/self/maps``), sorted: not shared memory
    (``/dev/shm``, memfd), which is as anonymous as the heap; empty where there is no such file."""
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        if path.startswith("/") and not path.startswith(("/dev/", "/memfd:")):
            lo, hi = parts[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return sorted(ranges)


def _inside(ranges: list[tuple[int, int]], ptr: int) -> bool:
    i = bisect.bisect_right(ranges, (ptr, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= ptr < ranges[i][1]
