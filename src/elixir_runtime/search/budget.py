"""How much GPU and host memory the model states may take (paper appendix A.1).

    U_allowed = F_alloc · (capacity − U_buffer − F_frag · U_activation)

``F_frag`` reserves room for the fragmentation activations cause (the only memory the caching
allocator churns); ``F_alloc`` a margin for what the allocator does not see (NCCL buffers, kernels
loaded on first use): 0.98, not the paper's 0.95 (docs/planning.md, "Budget"). ``capacity`` is at
most the process's GPU limit (``gpu_limit.py``) and excludes the CUDA context. The host keeps the
paper's 0.95 (``F_HOST``): the rest of the process lives beside the pinned arenas. The host's
capacity is the memory the run will have once the model's own weights are in chunks
(``host.HostMemory``: available now plus what they free; ``elixir-plan``: ``--host-mem``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..host import accounting, size_text

__all__ = ["Budget", "F_ALLOC", "F_FRAG", "F_HOST"]

F_ALLOC = 0.98
F_FRAG = 1.25
F_HOST = 0.95


@dataclass(frozen=True)
class Budget:
    capacity: int
    """GPU bytes per rank the plan may use in total."""
    activations: int
    buffers: int
    host_capacity: int
    """Host bytes the ranks on this host will have for their pinned arenas (before ``f_host``)."""
    ranks_per_host: int = 1
    limit: int | None = None
    """The process's GPU limit in bytes (``ElixirConfig.gpu_memory`` or total x torch's memory
    fraction), which ``capacity`` respects; ``None``: the whole GPU."""
    f_alloc: float = F_ALLOC
    f_frag: float = F_FRAG
    f_host: float = F_HOST
    """Share of ``host_capacity`` the pinned arenas may take."""
    host_released: int = 0
    """Of ``host_capacity``: what the model's own weights on this host free when taken into chunks
    (``host.HostMemory.released``; 0 for a plan made for another machine)."""
    host_activations: int = 0
    """Pinned host bytes per rank the held block inputs take (``ElixirPlan.activations`` ``"host"``),
    beside the arenas."""

    @property
    def allowed(self) -> int:
        """U_allowed: bytes per rank for rCache, private blocks and device arenas."""
        return int(self.f_alloc * (self.capacity - self.buffers - self.f_frag * self.activations))

    @property
    def host_allowed(self) -> int:
        """Bytes of pinned host arenas per rank (the held block inputs' taken off)."""
        return int(self.f_host * self.host_capacity / self.ranks_per_host) - self.host_activations

    def host_accounting(self) -> str:
        """How ``host_allowed`` comes about, in words (the no-fit message's)."""
        available = self.host_capacity - self.host_released
        return (
            f"{accounting(available, self.host_released)}, x {self.f_host} (the rest kept for the process) / "
            f"{self.ranks_per_host} rank(s)"
            + (f" - {size_text(self.host_activations)} for the held block inputs" if self.host_activations else "")
            + f" = {size_text(self.host_allowed)} of pinned host memory per rank"
        )

    def to_dict(self) -> dict[str, float]:
        out = {**asdict(self), "allowed": self.allowed, "host_allowed": self.host_allowed}
        if not self.host_activations:  # plans without held inputs on the host read as before it
            del out["host_activations"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Budget:
        """``allowed`` and ``host_allowed`` are derived: ignored."""
        return cls(**{k: v for k, v in data.items() if k not in ("allowed", "host_allowed")})
