"""``full_params``: every parameter on this rank, so that forwards run on some ranks only.

Training forwards are collectives (each unit gathers its chunks with the other ranks), so
sampling or evaluating on the main process needs the whole model there first, as FSDP's
``summon_full_params``::

    with elixir_runtime.full_params(model, rank0_only=True):   # every rank enters (a collective)
        if rank == 0:
            text = model.generate(**prompt)                    # any forward, on any subset of ranks

Entering is a collective: the ranks check in (``distributed/lockstep.py``) and gather every chunk
that is not gathered in the rCache into a buffer of its own (a chunk already gathered is used
where it is, and pinned). Inside, the module hooks stand by and autograd is off (the parameters
are a gathered copy in the compute dtype: a backward would not reach the shards; changes to
them are discarded at exit, FSDP's ``writeback=False``). Exiting is a collective too: the ranks
wait for each other (up to torch's default 30 minutes), so a long generation on rank 0 does not
trip the others' next forward.

Memory: the chunks not gathered in the rCache, in the compute dtype, on the compute device of
every rank that holds the full parameters, on top of the training state (nothing extra with
rCache max once every chunk is gathered). ``rank0_only=True``: only rank 0 holds them; the other
ranks gather through one chunk-sized buffer and may run no forward inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..distributed.lockstep import Op
from .chunk_runtime import ChunkRuntime
from .phase import Phase
from .state import ChunkState, ParamState

__all__ = ["full_params"]


@contextlib.contextmanager
def full_params(model: nn.Module, *, rank0_only: bool = False) -> Iterator[nn.Module]:
    """Inside, ``model`` holds every parameter on this rank (on rank 0 only with ``rank0_only``)
    and runs forwards without collectives. Enter and leave it on every rank."""
    state = getattr(model, "_elixir", None)
    if state is None:
        raise ValueError("full_params needs a model prepared by elixir_runtime.prepare")
    rt: ChunkRuntime = state.runtime
    phase = rt.ctx.phase
    if phase.full:
        raise RuntimeError("full_params is already entered on this model; leave it before entering it again")
    if phase.now is not Phase.IDLE or any(c.pins for c in rt.chunks):
        raise RuntimeError(
            "full_params cannot be entered during a forward or backward of the model; enter it between steps"
        )
    rt.ctx.lockstep.check_in(Op.FULL_PARAMS)
    rt.unpark()
    keep = not rank0_only or rt.ctx.coll.rank == 0
    pinned, copied = _gather_all(rt, keep)
    phase.to(Phase.FULL if keep else Phase.FULL_ELSEWHERE)
    try:
        with torch.no_grad():
            yield model
    finally:
        phase.to(Phase.IDLE)
        for c in copied:
            rt.gathers.hide_params(c)
            c.transition(ParamState.RELEASED)
        for c in pinned:
            c.pins -= 1
        rt.ctx.lockstep.barrier()


@torch.no_grad()
def _gather_all(rt: ChunkRuntime, keep: bool) -> tuple[list[ChunkState], list[ChunkState]]:
    """Makes every chunk's parameters full on this rank (if ``keep``); returns the chunks pinned in
    the rCache (``GATHERING``/``GATHERED``, left so) and those gathered into buffers of their own
    (``RELEASED -> COPIED``). The same on every rank: which chunks are gathered is."""
    rt.grads.wait_for_grads()  # CPU updates, reductions and prefetches settled
    pinned, copied = [], []
    largest = max((c.spec.numel for c in rt.chunks), default=0)  # a private chunk may exceed chunk_size
    scratch = None if keep else torch.empty(largest, dtype=rt.ctx.dtype, device=rt.ctx.device)
    for c in rt.chunks:
        if c.valid:
            if keep:
                c.pins += 1
                pinned.append(c)
            continue
        full = (
            torch.empty(c.spec.numel, dtype=rt.ctx.dtype, device=rt.ctx.device)
            if scratch is None
            else scratch[: c.spec.numel]
        )
        rt.gathers.fill(c, full)
        if keep:
            rt.gathers.show_params(c, full)
            c.transition(ParamState.COPIED)
            copied.append(c)
    return pinned, copied
