"""The rCache: ``n_blocks`` equal buffers on the compute device, allocated once, each as large as
the largest public chunk (``ChunkLayout.block_numel``).

A gathered chunk occupies one buffer; a private chunk (a multi-use parameter, or one larger than
the chunk size) has a buffer of its own, as large as it, that is never evicted. Buffers carry the
CUDA event after which their last reader or writer is done, so a gather into a recycled buffer
waits exactly as long as it must.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Buffer", "RCache"]


@dataclass(eq=False)
class Buffer:
    index: int
    data: torch.Tensor
    private: bool = False
    chunk: int | None = None
    free_event: torch.cuda.Event | None = None
    """Recorded when the buffer was released; a writer's stream waits on it first."""


class RCache:
    def __init__(self, n_blocks: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffers = [Buffer(i, torch.zeros(numel, dtype=dtype, device=device)) for i in range(n_blocks)]
        self.free: list[Buffer] = list(reversed(self.buffers))

    def private_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> Buffer:
        return Buffer(-1, torch.zeros(numel, dtype=dtype, device=device), private=True)
