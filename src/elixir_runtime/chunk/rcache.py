"""The rCache: ``n_blocks`` equal chunk-sized buffers on the compute device, allocated once.

A gathered chunk occupies one block; a private (multi-use) chunk has a block of its own that is
never evicted. Blocks carry the CUDA event after which their last reader or writer is done, so a
gather into a recycled block waits exactly as long as it must.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Block", "RCache"]


@dataclass(eq=False)
class Block:
    index: int
    data: torch.Tensor
    private: bool = False
    chunk: int | None = None
    free_event: torch.cuda.Event | None = None
    """Recorded when the block was released; a writer's stream waits on it first."""


class RCache:
    def __init__(self, n_blocks: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.blocks = [Block(i, torch.zeros(numel, dtype=dtype, device=device)) for i in range(n_blocks)]
        self.free: list[Block] = list(reversed(self.blocks))

    def private_block(self, numel: int, dtype: torch.dtype, device: torch.device) -> Block:
        return Block(-1, torch.zeros(numel, dtype=dtype, device=device), private=True)

