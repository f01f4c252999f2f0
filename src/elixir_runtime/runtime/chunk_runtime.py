"""``ChunkRuntime``: one engine's chunks, and the two parts that move them.

It builds the arenas (``chunk/store.py``), the rCache and one ``ChunkState`` per chunk
(``state.py``), and composes

* ``ChunkGathers`` (``gathers.py``): acquire, prefetch, gather, evict, release; each chunk's
  ``ParamState``;
* ``ChunkGradients`` (``gradients.py``): gradient write-back, reduce-scatter, end of backward,
  ``zero_grad``, the norm; each trainable chunk's ``GradState``.

Callers address the part they need (``runtime.gathers.acquire``, ``runtime.grads.on_grad``); the
states, their tables and where they are checked are in ``state.py``. Everything that moves chunk
data lives in those two modules; the module hooks only say *when*.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chunk.layout import ChunkLayout
from ..chunk.rcache import RCache
from ..chunk.store import Weights, Where, build_arenas, grads_on_demand, own_part
from ..distributed.collectives import Collectives
from ..distributed.lockstep import Lockstep
from .context import EngineContext
from .gathers import ChunkGathers, RCacheExhausted
from .gradients import ChunkGradients
from .host_updates import HostUpdates, Lane, update_order
from .state import ChunkState, GradState, ParamState
from .stats import EngineStats

__all__ = ["ChunkRuntime", "ChunkState", "GradState", "ParamState", "RCacheExhausted"]


class ChunkRuntime:
    def __init__(
        self,
        ctx: EngineContext,
        layout: ChunkLayout,
        placement: list[Where],
        n_blocks: int,
        prefetch: int,
        *,
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
        self.ctx, self.layout = ctx, layout
        dtype, device = ctx.dtype, ctx.device
        # the parameters' own storages go as their chunks fill: the runtime points them at its chunks
        self.arenas = build_arenas(layout, placement, ctx.coll.rank, device, dtype, ctx.state, weights, release=True)
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
        self.host_updates = HostUpdates(ctx.stats, lane)
        self.gathers = ChunkGathers(ctx, layout, self.chunks, self.rcache, prefetch, self.host_updates)
        self.grads = ChunkGradients(ctx, layout, self.chunks, self.gathers, self.host_updates, grads_share_activations)
        self.trainable = self.grads.trainable
        self.root_chunks = root_chunks
        by_index = {c.index: c for c in self.trainable}
        self.update_order = [by_index[i] for i in update_order(list(by_index), root_chunks)]
        """The trainable chunks in the order the next forward needs them (``host_updates.update_order``)."""
        self.parked: Callable[[], None] | None = None
        """While the parameters are parked (``full_params.park``): what gives them back to the engine."""

    # the context's, for the engine's users (the optimizer, the state-dict hooks, elixir_hf)
    @property
    def coll(self) -> Collectives:
        return self.ctx.coll

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ctx.dtype

    @property
    def lockstep(self) -> Lockstep:
        return self.ctx.lockstep

    @property
    def stats(self) -> EngineStats:
        """The counters now (``runtime/stats.py``), the GPU stalls whose events have run counted."""
        self.gathers.stalls.settle()
        return self.ctx.stats.now

    def unpark(self) -> None:
        """The parked parameters (``full_params.park``) back to the engine: placeholders, hooks on."""
        if self.parked is not None:
            restore, self.parked = self.parked, None
            restore()

    def invalidate_trainable(self) -> None:
        """After an update the gathered copies of trainable chunks are stale."""
        self.unpark()
        self.gathers.drop_all(self.trainable, "optimizer step")

    @torch.no_grad()
    def reload_shards(self) -> None:
        """After master/frozen shards were overwritten (checkpoint load): recast and drop stale buffers."""
        self.unpark()
        self.grads.wait_for_grads()
        for a in self.arenas.values():
            if a.param_copy is not None:
                a.param_copy.copy_(a.master)
        self.gathers.drop_all(self.chunks, "checkpoint load")
