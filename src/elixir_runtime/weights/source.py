"""Where ``prepare`` takes the starting weights from: each rank's own module, rank 0's, files, or the model's init.

A model too large to hold once per rank in host memory is built on the ``meta`` device on every
rank but rank 0 (in HF terms: ``from_pretrained`` on rank 0, ``from_config`` under
``torch.device("meta")`` elsewhere). ``prepare`` then fills every rank's shards from rank 0's
tensors, broadcast one at a time, so the host holds the model once instead of once per rank, and
a rank never holds more than its shards plus one tensor.

A model whose parameters are on meta on every rank and that carries where their values are
(``weights/attached.py``) is filled from there: safetensors files (``weights/stream.py``;
``elixir_hf.from_pretrained`` makes one), each rank reading only its shards' elements, or the
model's own init replayed on each rank's ranges on the compute device (``weights/init.py``;
``elixir_hf.from_config``). The host never holds the model at all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.collectives import Collectives
from ..host import host_total, local_ranks
from .attached import AttachedWeights, attached_weights, unguard

__all__ = ["WeightSource", "weight_source", "unmeta_parameters", "copies_warning"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSource:
    coll: Collectives
    comm_device: torch.device | None = None
    """Where broadcasts happen (the GPU under NCCL, the CPU under gloo); None: no broadcasts."""
    attached: AttachedWeights | None = None
    """Where the meta parameters' values are read from, on every rank (files, the model's init)."""
    device: torch.device | None = None
    """The compute device (where an init draws its values)."""

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

    def part(self, p: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``p``'s flattened starting value (``numel`` may be 0).

        A collective when broadcasting: every rank calls it for every parameter in the same order.
        """
        if self.attached is not None and self.attached.covers(p):
            return self.attached.read(p, start, numel, self.device)
        return self.value(p).reshape(-1)[start : start + numel]

    @contextlib.contextmanager
    def reading(self, device: torch.device) -> Iterator[None]:
        """Around the fill: a read that fails on one rank fails ``prepare`` on every rank (a
        collective when reading attached weights on several ranks), never leaving a partly filled model."""
        if self.attached is None:
            yield
            return
        error = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = f"{type(e).__name__}: {e}"
            failure: Exception | None = e
        else:
            failure = None
        finally:
            self.attached.close()
        errors = [f"rank {r}: {e}" for r, e in enumerate(self.coll.everyones(error, device)) if e is not None]
        if errors:
            raise RuntimeError(
                f"reading the weights from {self.attached.origin} failed:\n  " + "\n  ".join(errors)
            ) from failure


def weight_source(model: nn.Module, coll: Collectives, device: torch.device) -> WeightSource:
    """Checks where the weights are and picks the source; raises before any memory is allocated.

    Every rank's module must hold all of its tensors, or (on ranks other than 0) none of them. If
    any rank holds none, all ranks start from rank 0's values, as FSDP's ``sync_module_states``.
    """
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    attached = attached_weights(model)
    if attached is not None:
        return _attached(model, attached, tensors, coll, device)
    params = list(model.named_parameters(remove_duplicate=False))
    on_meta = [name for name, t in params if t.is_meta]
    meta_buffers = [name for name, t in model.named_buffers(remove_duplicate=False) if t.is_meta]
    if (on_meta and len(on_meta) < len(params)) or (meta_buffers and not on_meta):
        real = next(name for name, t in params if not t.is_meta)
        raise ValueError(
            f"{len(on_meta) + len(meta_buffers)} of {len(tensors)} tensors are on the meta device (e.g. "
            f"{(on_meta or meta_buffers)[0]!r}, while {real!r} is not): build the model either with all its weights "
            "or, on ranks other than 0, with its parameters on meta (its buffers come from rank 0 either way)"
        )
    if coll.world_size == 1:
        if on_meta:
            raise ValueError("model has parameters on the meta device; materialize its weights before prepare")
        return WeightSource(coll)
    everyone = coll.everyones((bool(on_meta), _signature(tensors)), device)
    if everyone[0][0]:
        raise ValueError(
            "rank 0's model is on the meta device: rank 0 must hold the weights (load or initialise them there); "
            "the other ranks may build the model on meta to save host memory"
        )
    _check_same_model([signature for _, signature in everyone])
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


def _attached(
    model: nn.Module,
    source: AttachedWeights,
    tensors: list[tuple[str, torch.Tensor]],
    coll: Collectives,
    device: torch.device,
) -> WeightSource:
    """A model whose meta parameters are read from an attached source: every rank checks its own
    model and source, then all ranks agree (an error anywhere is raised everywhere, before anything
    is allocated)."""
    uncovered = [name for name, t in tensors if t.is_meta and not source.covers(t)]
    problem = source.check()
    if uncovered:
        problem = (
            f"{len(uncovered)} tensors are on the meta device and not in {source.origin} (e.g. {uncovered[:3]}): "
            "a module added after building on meta (such as a PEFT adapter) or a buffer has no values; build the "
            f"model with its values ({source.fallback})"
        )
    everyone = coll.everyones((problem, _signature(tensors), source.agreement()), device)
    errors = [f"rank {r}: {p}" if coll.world_size > 1 else p for r, (p, _, _) in enumerate(everyone) if p is not None]
    if errors:
        raise ValueError("; ".join(errors))
    _check_same_model([signature for _, signature, _ in everyone])
    for rank, (_, _, theirs) in enumerate(everyone):
        if theirs != everyone[0][2]:
            raise ValueError(
                f"rank {rank}'s weights from {source.origin} differ from rank 0's ({theirs} vs {everyone[0][2]}): "
                "every rank must build the model the same way (the same seed: transformers.set_seed or "
                "torch.manual_seed with one value on every rank before building it, or pass seed=)"
            )
    unguard(source)
    if coll.rank == 0:
        logger.info("elixir: every rank fills its shards of the weights from %s", source.origin)
    return WeightSource(coll, attached=source, device=device)


def _signature(tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    return [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in tensors]


def _check_same_model(signatures: list[list[str]]) -> None:
    for rank, theirs in enumerate(signatures[1:], start=1):
        if theirs != signatures[0]:
            diff = next((f"{a!r} vs {b!r}" for a, b in zip(signatures[0], theirs) if a != b), f"{len(theirs)} tensors")
            raise ValueError(
                f"rank {rank}'s model differs from rank 0's (rank 0 vs rank {rank}: {diff}): build the same model, with "
                "the same dtype, on every rank"
            )


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
