"""How much GPU and host memory the model states may take (paper appendix A.1).

    U_allowed = F_alloc · (capacity − U_buffer − F_frag · U_activation)

``F_frag`` reserves room for the fragmentation activations cause (they are the only memory the
caching allocator churns: everything else is allocated once, up front); ``F_alloc`` keeps a
margin for what the allocator does not see (NCCL buffers, kernels loaded on first use).
``capacity`` is at most the process's GPU limit (``ElixirConfig.gpu_memory``, torch's memory
fraction: ``gpu_limit.py``) and excludes the CUDA context already (free memory at ``prepare`` plus
what torch's allocator caches unused).

``F_ALLOC`` is 0.98, not the paper's 0.95: on one H100 80GB the paper's factor left 4.8-5.8 GiB of
the 78.6 GiB capacity never reserved (Llama-3-8B / Qwen2.5-7B batch 4 x 2048, the caching
allocator's peak reserved 72.8-73.8 GiB with expandable segments), 5 % of ~70 GiB where the memory
outside the allocator is a few hundred MiB (2 x H100 runs: 7-8 GiB never reserved). 2 % of it
(1.4 GiB) moved ~0.18 G elements of optimizer state to the GPU: 2 % off the predicted Llama-3-8B step.
The host keeps the paper's 0.95 (``F_HOST``): pinned memory is allocated at its exact size, but
the rest of the process (the model built on the CPU, the dataloader) lives beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Budget", "F_ALLOC", "F_FRAG", "F_HOST"]

F_ALLOC = 0.98
F_FRAG = 1.25
F_HOST = 0.95


@dataclass
class Budget:
    capacity: int
    """GPU bytes per rank the plan may use in total."""
    activations: int
    buffers: int
    host_capacity: int
    """Host bytes usable by the pinned arenas of all ranks on the host."""
    ranks_per_host: int = 1
    limit: int | None = None
    """The process's GPU limit in bytes (``ElixirConfig.gpu_memory`` or total x torch's memory
    fraction), which ``capacity`` respects; ``None``: the whole GPU."""
    f_alloc: float = F_ALLOC
    f_frag: float = F_FRAG
    f_host: float = F_HOST
    """Share of ``host_capacity`` the pinned arenas may take."""

    @property
    def allowed(self) -> int:
        """U_allowed: bytes per rank for rCache, private blocks and device arenas."""
        return int(self.f_alloc * (self.capacity - self.buffers - self.f_frag * self.activations))

    @property
    def host_allowed(self) -> int:
        """Bytes of pinned host arenas per rank."""
        return int(self.f_host * self.host_capacity / self.ranks_per_host)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "allowed": self.allowed, "host_allowed": self.host_allowed}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> "Budget":
        """``allowed`` and ``host_allowed`` are derived: ignored."""
        return cls(**{k: v for k, v in data.items() if k not in ("allowed", "host_allowed")})
