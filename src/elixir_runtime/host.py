"""This host: its RAM (``/proc/meminfo``, read in one place) and the ranks sharing it.

Used by the memory budget of the search, the plan's check against available RAM, the hardware
measurement and the warning about every rank holding its own copy of the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["host_available", "host_total", "local_ranks"]


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
