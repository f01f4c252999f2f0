"""Where ``prepare`` takes the starting weights from: each rank's own module, or rank 0's.

A model too large to hold once per rank in host memory is built on the ``meta`` device on every
rank but rank 0 (in HF terms: ``from_pretrained`` on rank 0, ``from_config`` under
``torch.device("meta")`` elsewhere; ``elixir_hf.from_pretrained`` does both). ``prepare`` then fills
every rank's shards from rank 0's tensors, broadcast one at a time, so the host holds the model
once instead of once per rank, and a rank never holds more than its shards plus one tensor.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..host import host_total, local_ranks
from .collectives import Collectives

__all__ = ["WeightSource", "weight_source", "unmeta_parameters", "copies_warning"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSource:
    coll: Collectives
    comm_device: torch.device | None = None
    """Where broadcasts happen (the GPU under NCCL, the CPU under gloo); None: no broadcasts."""

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """The full value of ``t`` as rank 0 holds it; ``t`` itself when every rank has its own.

        A collective when ``comm_device`` is set: every rank calls it for the same tensors in the same order.
        """
        if self.comm_device is None:
            return t.detach()
        if self.coll.rank == 0:
            out = t.detach().to(self.comm_device)
        else:
            out = torch.empty(t.shape, dtype=t.dtype, device=self.comm_device)
        dist.broadcast(out, src=self.coll.source_rank, group=self.coll.group)
        return out


def weight_source(model: nn.Module, coll: Collectives, device: torch.device) -> WeightSource:
    """Checks where the weights are and picks the source; raises before any memory is allocated.

    Every rank's module must hold all of its tensors, or (on ranks other than 0) none of them. If
    any rank holds none, all ranks start from rank 0's values, as FSDP's ``sync_module_states``.
    """
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    on_meta = [name for name, t in tensors if t.is_meta]
    if on_meta and len(on_meta) < len(tensors):
        real = next(name for name, t in tensors if not t.is_meta)
        raise ValueError(
            f"{len(on_meta)} of {len(tensors)} tensors are on the meta device (e.g. {on_meta[0]!r}, while {real!r} is "
            "not): build the model either with all its weights or, on ranks other than 0, entirely on meta"
        )
    if coll.world_size == 1:
        if on_meta:
            raise ValueError("model has parameters on the meta device; materialize its weights before prepare")
        return WeightSource(coll)
    signature = [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in tensors]
    everyone: list = [None] * coll.world_size
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(everyone, (bool(on_meta), signature), group=coll.group)
    if everyone[0][0]:
        raise ValueError(
            "rank 0's model is on the meta device: rank 0 must hold the weights (load or initialise them there); "
            "the other ranks may build the model on meta to save host memory"
        )
    for rank, (_, theirs) in enumerate(everyone[1:], start=1):
        if theirs != everyone[0][1]:
            diff = next((f"{a!r} vs {b!r}" for a, b in zip(everyone[0][1], theirs) if a != b), f"{len(theirs)} tensors")
            raise ValueError(
                f"rank {rank}'s model differs from rank 0's (rank 0 vs rank {rank}: {diff}): build the same model, with "
                "the same dtype, on every rank"
            )
    if not any(meta for meta, _ in everyone):
        if coll.rank == 0:
            unique = {id(t): t for _, t in tensors}.values()
            hint = copies_warning(sum(t.numel() * t.element_size() for t in unique), local_ranks(), host_total())
            if hint:
                logger.warning("elixir: %s", hint)
        return WeightSource(coll)
    backend = dist.get_backend(coll.group)
    if coll.rank == 0:
        on_meta_ranks = [rank for rank, (meta, _) in enumerate(everyone) if meta]
        logger.info(
            "elixir: ranks %s hold no weights: every rank's shards start from rank 0's %d tensors, broadcast "
            "one at a time",
            on_meta_ranks,
            len(tensors),
        )
    return WeightSource(coll, device if backend == "nccl" else torch.device("cpu"))


COPIES_WARN_SHARE = 0.25
"""Warn when the ranks' own copies of the weights take more than this share of the host's RAM."""


def copies_warning(weight_bytes: int, ranks_here: int, host_bytes: int) -> str | None:
    """The hint for a job whose every rank built the weights, when together they crowd the host."""
    if ranks_here < 2 or weight_bytes * ranks_here <= COPIES_WARN_SHARE * host_bytes:
        return None
    gib = 2**30
    return (
        f"every rank holds its own copy of the weights ({ranks_here} x {weight_bytes / gib:.1f} GiB of "
        f"{host_bytes / gib:.0f} GiB host RAM) until they are sharded: build the model on meta on ranks other than 0 "
        "(elixir_hf.from_pretrained / from_config do) to hold it once"
    )


def unmeta_parameters(params: list[nn.Parameter]) -> None:
    """Turns meta parameters into CPU ones of the same shape that hold no memory, in place.

    The engine points every parameter at its chunk through ``.data``, which a meta tensor refuses;
    swapping keeps the Python objects the user's optimizer already holds.
    """
    for p in params:
        if p.is_meta:
            stub = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, stub)
