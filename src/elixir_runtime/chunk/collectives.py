"""The two collectives a chunk needs, in place, with a gloo fallback for CPU tests.

NCCL gathers and reduce-scatters in place on the chunk buffer (the local shard is the rank's
slice of it). gloo lacks the ``*_tensor`` forms and AVG, so it goes through list forms and SUM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Collectives"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# torch 2.13 renamed the tensor-form collectives (the old names warn); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """Binds a process group; ``world_size == 1`` turns both collectives into no-ops."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.gloo = self.distributed and dist.get_backend(group) == "gloo"

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full chunk buffer."""
        size = full.numel() // self.world_size
        return full[self.rank * size : (self.rank + 1) * size]

    def all_gather_(self, full: torch.Tensor) -> None:
        """Fills ``full`` from every rank's slice (this rank's slice already holds its shard)."""
        if self.world_size == 1:
            return
        if self.gloo:  # gloo moves bytes of any dtype as integers of the same width
            raw = full.view(_INT_OF_WIDTH[full.element_size()])
            parts = list(raw.chunk(self.world_size))
            dist.all_gather(parts, self.shard_of(raw).clone(), group=self.group)
        else:
            _all_gather_single(full, self.shard_of(full), group=self.group)

    def reduce_scatter_avg_(self, full: torch.Tensor) -> torch.Tensor:
        """Averages ``full`` over ranks into this rank's slice of it, which is returned."""
        if self.world_size == 1:
            return full
        full.div_(self.world_size)
        shard = self.shard_of(full)
        if self.gloo:  # no reduce-scatter and no low-precision sums in gloo
            summed = full.float()
            dist.all_reduce(summed, group=self.group)
            full.copy_(summed)
        else:
            _reduce_scatter_single(shard, full, group=self.group)
        return shard

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
