"""Bytes per rank of a placement, counted exactly as the engine allocates them.

The engine's arenas (``chunk/store.py``) hold, per chunk shard: the compute-dtype parameter, and
for trainable chunks the compute-dtype gradient, fp32 Adam m and v, and an fp32 master (aliased
to the parameter in fp32 runs). The rCache is ``n_blocks`` chunk-sized blocks in the compute
dtype; each private (tied) chunk has a full-size block of its own. Host arenas are pinned at
their exact size, so they are host memory that nothing else can use.
"""

from __future__ import annotations

import numpy as np
import torch

from ..chunk.layout import ChunkLayout

__all__ = ["ArenaBytes", "state_bytes_per_element"]


def state_bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes per element a trainable shard adds to its parameter: grad, m, v (+ fp32 master)."""
    elt = torch.empty((), dtype=dtype).element_size()
    return elt + 8 + (0 if dtype == torch.float32 else 4)


class ArenaBytes:
    """Per-chunk arena sizes of one layout, for fast sums over placements."""

    def __init__(self, layout: ChunkLayout, dtype: torch.dtype) -> None:
        elt = torch.empty((), dtype=dtype).element_size()
        self.elt = elt
        self.buffer = layout.chunk_size * elt
        """Bytes of one rCache buffer (a chunk of the compute dtype)."""
        shard = np.array([layout.shard_numel(c) for c in layout.chunks], dtype=np.int64)
        trainable = np.array([c.trainable for c in layout.chunks])
        self.arena = shard * (elt + np.where(trainable, state_bytes_per_element(dtype), 0))
        self.private = int(sum(c.numel * elt for c in layout.chunks if c.private))

    def device(self, n_blocks: int, on_device: np.ndarray) -> int:
        """rCache + private buffers + the arenas of the chunks placed on the device."""
        return n_blocks * self.buffer + self.private + int(self.arena[on_device].sum())

    def host(self, on_device: np.ndarray) -> int:
        """Pinned host arenas of this rank."""
        return int(self.arena[~on_device].sum())
