"""``ChunkRuntime``: one engine's chunks, and the two parts that move them.

It builds the arenas (``chunk/store.py``), the rCache and one ``ChunkState`` per chunk
(``state.py``), and composes

* ``ChunkResidency`` (``gathers.py``): acquire, prefetch, gather, evict, release; each chunk's
  ``ParamState``;
* ``ChunkGradients`` (``gradients.py``): gradient write-back, reduce-scatter, end of backward,
  ``zero_grad``, the norm; each trainable chunk's ``GradState``.

Callers address the part they need (``runtime.resident.acquire``, ``runtime.grads.on_grad``); the
states, their tables and where they are checked are in ``state.py``. Everything that moves chunk
data lives in those two modules; the module hooks only say *when*.
"""

from __future__ import annotations

import torch

from ..chunk.layout import ChunkLayout
from ..chunk.rcache import RCache
from ..chunk.store import Residence, Weights, build_arenas, grads_on_demand, own_part
from ..distributed.collectives import Collectives
from ..distributed.lockstep import Lockstep
from .gathers import ChunkResidency, RCacheExhausted
from .gradients import ChunkGradients
from .host_updates import HostUpdates, Lane, update_order
from .state import ChunkState, GradState, ParamState, Residency

__all__ = ["ChunkRuntime", "ChunkState", "GradState", "ParamState", "RCacheExhausted", "Residency"]


class ChunkRuntime:
    def __init__(
        self,
        layout: ChunkLayout,
        placement: list[Residence],
        n_blocks: int,
        coll: Collectives,
        device: torch.device,
        dtype: torch.dtype,
        prefetch: int,
        lockstep: Lockstep,
        weights: Weights = own_part,
        lane: Lane | None = None,
        grads_share_activations: bool = False,
        root_chunks: tuple[int, ...] = (),
    ) -> None:
        """``weights`` gives a range of a parameter's value its shards start from (``WeightSource.part``);
        ``lane``: the device lane that updates offloaded slices beside the CPU (``runtime/device_lane.py``);
        ``grads_share_activations``: the plan let the GPU's gradient shards use memory the loss's
        activations free (one micro-batch per step, ``search.memory.GradWindow``); ``root_chunks``:
        the private chunks every forward acquires first (parameters read outside their units)."""
        self.layout, self.coll, self.device, self.dtype = layout, coll, device, dtype
        self.lockstep = lockstep
        self.residency = Residency.SHARDED
        self.cuda = device.type == "cuda"
        # the parameters' own storages go as their chunks fill: the runtime points them at its chunks
        self.arenas = build_arenas(layout, placement, coll.rank, device, dtype, weights, release=True)
        self.rcache = RCache(n_blocks, layout.block_numel, dtype, device)
        self.chunks = [
            ChunkState(
                spec,
                self.arenas[placement[spec.index]],
                self.arenas[placement[spec.index]].offsets[spec.index],
                layout.shard_numel(spec),
                name=layout.names[spec.slots[0].param][0] if spec.slots else "",
                n_grad_params=len(spec.slots) if spec.trainable else 0,
            )
            for spec in layout.chunks
        ]
        for c in self.chunks:
            if c.spec.private:
                c.buffer = self.rcache.private_buffer(c.spec.numel, dtype, device)
            if c.spec.trainable and not grads_on_demand(c.shards.placement):
                c.grad = c.shards.grad[c.offset : c.offset + c.shard_numel]
        self.stats = {
            "gathers": 0,
            "prefetches": 0,
            "evictions": 0,
            "reduces": 0,
            "updated_cpu": 0,
            "updated_device": 0,
            "cpu_update_s": 0.0,
            "update_wait_s": 0.0,
        }
        """Counters since prepare, for logging and tests (``updated_*``: offloaded elements each update
        lane updated; ``cpu_update_s``: seconds the CPU lane spent updating them; ``update_wait_s``:
        seconds the loop's thread waited for them)."""
        self.host_updates = HostUpdates(lane, self.stats)
        self.resident = ChunkResidency(
            layout, self.chunks, self.rcache, coll, device, dtype, prefetch, self.host_updates, self.stats
        )
        self.grads = ChunkGradients(
            layout,
            self.chunks,
            self.resident,
            coll,
            device,
            dtype,
            self.host_updates,
            self.stats,
            grads_share_activations,
        )
        self.trainable = self.grads.trainable
        self.root_chunks = root_chunks
        by_index = {c.index: c for c in self.trainable}
        self.update_order = [by_index[i] for i in update_order(list(by_index), root_chunks)]
        """The trainable chunks in the order the next forward needs them (``host_updates.update_order``)."""

    def invalidate_trainable(self) -> None:
        """After an update the gathered copies of trainable chunks are stale."""
        self.resident.drop_all(self.trainable, "optimizer step")

    @torch.no_grad()
    def reload_shards(self) -> None:
        """After master/frozen shards were overwritten (checkpoint load): recast and drop stale buffers."""
        self.grads.wait_for_grads()
        for a in self.arenas.values():
            if a.param_copy is not None:
                a.param_copy.copy_(a.master)
        self.resident.drop_all(self.chunks, "checkpoint load")
