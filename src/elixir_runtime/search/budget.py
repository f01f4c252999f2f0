"""How much GPU and host memory the model states may take (paper appendix A.1).

    U_allowed = F_alloc · (capacity − U_buffer − F_frag · U_activation)

``F_frag`` reserves room for the fragmentation activations cause (they are the only memory the
caching allocator churns: everything else is allocated once, up front); ``F_alloc`` keeps a
margin for what the allocator does not see (CUDA context, NCCL buffers). The host side takes the
same ``F_alloc`` of the host's RAM for the pinned arenas of every rank on it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Budget", "device_budget", "host_available", "host_total", "local_ranks", "F_ALLOC", "F_FRAG"]

F_ALLOC = 0.95
F_FRAG = 1.25


@dataclass
class Budget:
    capacity: int
    """GPU bytes per rank the plan may use in total."""
    activations: int
    buffers: int
    host_capacity: int
    """Host bytes usable by the pinned arenas of all ranks on the host."""
    ranks_per_host: int = 1
    f_alloc: float = F_ALLOC
    f_frag: float = F_FRAG

    @property
    def allowed(self) -> int:
        """U_allowed: bytes per rank for rCache, private blocks and device arenas."""
        return int(self.f_alloc * (self.capacity - self.buffers - self.f_frag * self.activations))

    @property
    def host_allowed(self) -> int:
        """Bytes of pinned host arenas per rank."""
        return int(self.f_alloc * self.host_capacity / self.ranks_per_host)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "allowed": self.allowed, "host_allowed": self.host_allowed}


def device_budget(device: torch.device, activations: int, buffers: int, ranks_per_host: int) -> Budget:
    """The budget of a live CUDA device: what is free now plus what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return Budget(
        capacity=free + cached,
        activations=activations,
        buffers=buffers,
        host_capacity=host_available(),
        ranks_per_host=ranks_per_host,
    )


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
