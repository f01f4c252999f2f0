"""The two collectives a chunk needs, both in place on the full chunk buffer.

The local shard is this rank's slice of the chunk buffer, so the all-gather needs no staging
copy and the reduce-scatter leaves this rank's averaged slice where it was.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .peer_failure import FailureBoard

T = TypeVar("T")

__all__ = ["Collectives", "HeldWork", "abort_groups"]

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
        self._held = HeldWork() if self.distributed and dist.get_backend(group) == "gloo" else None
        self.board: FailureBoard | None = None
        """Where a rank that gives up leaves its reason (set by the engine's ``distributed/lockstep.py``)."""

    @property
    def source_rank(self) -> int:
        """The global rank of this group's rank 0: the one that decides and that others copy."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def decided_by_rank0(self, decide: Callable[[], T], device: torch.device) -> T:
        """``decide()`` run on rank 0 only, its (picklable) result given to every rank.

        For choices every rank must share (chunk layout, plan) but that could come out differently
        per rank (free memory, a trace that fails on a rank holding a meta model).
        """
        decided: list[T | None] = [decide() if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(decided, src=self.source_rank, group=self.group, device=device)
        return cast("T", decided[0])  # rank 0's, on every rank

    def everyones(self, obj: T, device: torch.device) -> list[T]:
        """Every rank's (picklable) ``obj``, in rank order: a collective; ``[obj]`` on one rank."""
        if self.world_size == 1:
            return [obj]
        everyone: list[T | None] = [None] * self.world_size
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            dist.all_gather_object(everyone, obj, group=self.group)
        return cast("list[T]", everyone)  # all_gather_object set every rank's entry

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full chunk buffer."""
        size = full.numel() // self.world_size
        return full[self.rank * size : (self.rank + 1) * size]

    def all_gather_(self, full: torch.Tensor) -> None:
        """Fills ``full`` from every rank's slice (this rank's slice already holds its shard)."""
        if self.world_size > 1:
            self._run(_all_gather_single, full, self.shard_of(full))

    def reduce_scatter_avg_(self, full: torch.Tensor) -> torch.Tensor:
        """Averages ``full`` over ranks into this rank's slice of it, which is returned.

        Pre-dividing (rather than ReduceOp.AVG, which gloo lacks for some dtypes) also keeps fp16
        sums from overflowing.
        """
        if self.world_size == 1:
            return full
        full.div_(self.world_size)
        shard = self.shard_of(full)
        self._run(_reduce_scatter_single, shard, full)
        return shard

    def all_reduce_sum_(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            self._run(dist.all_reduce, t)

    def all_reduce_max_(self, t: torch.Tensor) -> None:
        if self.world_size > 1:
            self._run(functools.partial(dist.all_reduce, op=dist.ReduceOp.MAX), t)

    def _run(self, collective: Callable[..., object], *tensors: torch.Tensor) -> None:
        """``collective(*tensors)`` to completion; on gloo through ``HeldWork`` ([Note: gloo at exit]),
        its failure explained by a rank that gave up ([Note: the rank that ran ahead]). Not on NCCL:
        holding its handles would keep temporary chunk buffers alive on the GPU."""
        if self._held is None:
            collective(*tensors, group=self.group)
            return
        try:
            self._held.run(collective, *tensors, group=self.group)
        except RuntimeError as exc:
            if self.board is not None:
                self.board.raise_posted(exc, "this rank's engine collective")
            raise


class HeldWork:
    """Runs gloo collectives to completion and keeps each one's work handle until two later ones
    have run, so that the calling thread, not gloo's worker, frees it and its tensors.

    [Note: gloo at exit] If gloo's worker thread drops the last reference to a finished work while
    the interpreter exits, freeing the work's Python-made tensors takes the GIL there and aborts
    the rank (SIGABRT, ``terminate called without an active exception``; docs/runtime.md,
    "Semantics worth knowing"). The engine's chunk collectives and lockstep check-ins go through
    one of these; and the process groups are destroyed at exit, before the interpreter
    finalizes, so that no gloo thread outlives it (``_destroy_groups``).
    """

    _every: weakref.WeakSet[HeldWork] = weakref.WeakSet()

    def __init__(self) -> None:
        self._recent: collections.deque[dist.Work] = collections.deque(maxlen=2)
        HeldWork._every.add(self)
        _destroy_groups_at_exit()

    def run(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        work = collective(*args, async_op=True, **kwargs)
        work.wait()
        self._recent.append(work)


@functools.cache
def _destroy_groups_at_exit() -> None:
    atexit.register(_destroy_groups)


def abort_groups() -> None:
    """Every process group of this rank aborted now, so that a peer blocked in a collective with this
    rank fails at once rather than when this process ends ([Note: the rank that ran ahead]). The held
    works go first: each keeps its gloo connections open."""
    for held in list(HeldWork._every):
        held._recent.clear()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.4; else: at exit
    if abort is not None and dist.is_initialized():
        with contextlib.suppress(Exception):  # the rank raises its own error next
            abort()


def _destroy_groups() -> None:
    """At exit, once: every process group, as torch asks of a job before it ends (the Trainer and
    Accelerate do not); a group's gloo threads then end while Python can still free their tensors.
    Then the heap is left to the OS ([Note: the heap at exit]).

    [Note: the heap at exit]
    Once the atexit handlers have run (a few hundredths of a second, this one included), a rank's
    process spent seconds more before it ended (docs/hf.md, "A rank that stops answering"): CPython's
    finalization clears the modules and collects and frees what is left in reference cycles (torch's
    and transformers' modules track 430,000 objects), then libtorch's static destructors run. A
    failed job's ranks lingered as long, and a launcher waits for each. Frozen (``gc.freeze``), those objects are left out
    of the collections and the OS takes their memory. What must be written is written before: the atexit
    handlers all run (logging's flush, the beat's ``left``, the groups' destruction, those registered
    before this one after it), then Python flushes stdout and stderr and clears the modules; only
    the finalizers of objects in reference cycles still alive at exit do not run, which Python does
    not promise at exit either."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a group already torn down, or a peer already gone
            dist.destroy_process_group()
    gc.freeze()
