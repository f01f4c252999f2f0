"""``full_params``: every parameter on this rank, so that forwards run on some ranks only; ``park``:
the trained values readable between steps.

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

``park``: the trained values in ``model.parameters()`` while no step runs.

Between steps every parameter's ``.data`` is a zero-stride placeholder (``chunk/store.release_param``)
or a view into an rCache buffer: code that reads ``model.parameters()`` after training (a check that
the weights moved, a comparison of two runs) would read zeros. ``park(model)`` (``elixir_hf`` calls it
when ``Trainer.train``, ``evaluate`` or ``predict`` return) points each parameter at its trained value,
in its original dtype and shape, and takes the units' hooks off the model; the root's hook stays and,
at the next forward, gives the parameters back to the engine (``ChunkRuntime.unpark``: placeholders,
hooks back on). So do ``full_params``, a step and a checkpoint load.

Where the values are (``Parked.where``):

* ``"shards"``: one rank, and the value is in a shard arena in the parameter's dtype (the fp32 master
  of a trainable parameter of an fp32 model; the compute-dtype shard of a frozen one, or the
  compute-dtype copy an offloaded chunk keeps): a view of it, no memory. On a GPU the on-device
  chunks' parameters are on the GPU, the offloaded chunks' in (pinned) host memory.
* ``"device"`` / ``"host"``: otherwise (several ranks: each holds a shard of each chunk; a dtype no
  arena holds), a copy of each chunk gathered from every rank, cast to each parameter's dtype, on the
  compute device when the copies fit in the GPU memory free beside the engine's (rCache and model
  states stay; activations are gone between steps), else in host memory when they fit in what the
  host has available; else the parameters stay placeholders, with a warning (``None``).

[Note: parked values are a snapshot]
A parked parameter is what the model's forward would compute with, but not the engine's state: the
engine takes its values from its shards at the next step, not from the parameters. An in-place write
to a view (``"shards"``) lands in the shard, and one to a copy is dropped, as inside ``full_params``
(FSDP's ``writeback=False``): write weights with ``load_state_dict``, which the engine takes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..chunk.store import shard_overlap
from ..distributed.lockstep import Op
from ..host import host_available, size_text
from .chunk_runtime import ChunkRuntime
from .phase import Phase
from .state import ChunkState, ParamState

__all__ = ["Parked", "full_params", "park"]

logger = logging.getLogger(__name__)


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


HEADROOM = 0.9
"""The share of the free GPU (or available host) memory parked copies may take."""


@dataclass(frozen=True)
class Parked:
    where: Literal["shards", "device", "host"] | None
    """Where the parameters' values are (module docstring); ``None``: nowhere, no room (placeholders)."""
    copied_bytes: int
    """Bytes of this rank's copies (0 for views of the shards)."""
    restore: Callable[[], None]

    def __call__(self) -> None:
        """Back to the engine (``ChunkRuntime.unpark``): placeholders, the units' hooks on."""
        self.restore()


@torch.no_grad()
def park(model: nn.Module) -> Parked:
    """Points every parameter of ``model`` (prepared by ``elixir_runtime.prepare``) at its trained
    value until the next forward, step, load or ``full_params``; a collective with several ranks
    (call it on every rank). Parking a parked model does nothing."""
    state: Any = getattr(model, "_elixir", None)  # api.ElixirState, a layer above
    if state is None:
        raise ValueError("park needs a model prepared by elixir_runtime.prepare")
    rt = state.runtime
    if isinstance(rt.parked, Parked):
        return rt.parked
    if rt.ctx.phase.now is not Phase.IDLE or any(c.pins for c in rt.chunks):
        raise RuntimeError("park: the model is inside a forward, backward or full_params; park it between steps")
    rt.grads.wait_for_grads()
    rt.gathers.drop_all(rt.chunks, "parking the parameters")
    dtypes = state.model_state.orig_dtypes
    views = [_views(rt, c, dtypes) for c in rt.chunks] if rt.coll.world_size == 1 else [None]
    where: Literal["shards", "device", "host"] | None
    if all(v is not None for v in views):
        where, values = "shards", dict(kv for v in views for kv in v or ())
    else:
        where = _room(rt, dtypes)
        values = dict(_gathered(rt, dtypes, where))
    for i, v in values.items():
        rt.layout.params[i].data = v
    hooks = state.hooks
    hooks.detach_units()

    def restore() -> None:
        for c in rt.chunks:
            rt.gathers.hide_params(c)
        hooks.attach_units()

    copied = 0 if where == "shards" else sum(v.numel() * v.element_size() for v in values.values())
    rt.parked = parked = Parked(where, copied, restore)
    return parked


def _views(rt: ChunkRuntime, c: ChunkState, dtypes: list[torch.dtype]) -> list[tuple[int, torch.Tensor]] | None:
    """Views of chunk ``c``'s parameters in its shard (one rank: the whole chunk), or ``None`` where a
    parameter's dtype is in no arena: a trainable one's fp32 master, else the compute-dtype shard
    (frozen) or copy (offloaded, mixed precision)."""
    arenas, layout, n = c.shards, rt.layout, c.shard_numel
    out = []
    for s in c.spec.slots:
        dtype = dtypes[s.param]
        if c.spec.trainable and dtype == torch.float32:
            base = arenas.master[c.offset : c.offset + n]
        elif dtype == rt.dtype and (not c.spec.trainable or arenas.param_copy is not None):
            base = arenas.source(c.offset, n, trainable=False)
        else:
            return None
        start, _, numel = shard_overlap(layout, c.spec, s, 0) or (0, 0, 0)
        assert numel == s.numel, "one rank holds every element of its chunks"
        out.append((s.param, base[start : start + numel].view(layout.params[s.param].shape)))
    return out


def _copy_bytes(rt: ChunkRuntime, dtypes: list[torch.dtype]) -> int:
    return sum(p.numel() * dtypes[i].itemsize for i, p in enumerate(rt.layout.params))


def _room(rt: ChunkRuntime, dtypes: list[torch.dtype]) -> Literal["device", "host"] | None:
    """Where this rank's copies fit: the compute device, else the host, else nowhere (warned)."""
    need = _copy_bytes(rt, dtypes)
    if rt.ctx.cuda and need <= HEADROOM * torch.cuda.mem_get_info(rt.device)[0]:
        return "device"
    if need <= HEADROOM * host_available():
        return "host"
    logger.warning(
        "elixir: the trained parameters (%s in their dtypes) fit neither the GPU nor the host memory free now: "
        "model.parameters() read placeholders until the next step; read the weights with model.state_dict() or "
        "inside elixir_runtime.full_params(model)",
        size_text(need),
    )
    return None


def _gathered(
    rt: ChunkRuntime, dtypes: list[torch.dtype], where: Literal["device", "host"] | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each parameter's value gathered from every rank's shard (a collective: every rank gathers
    every chunk, whether it keeps the values or not), cast to its dtype, on ``where``."""
    rt.lockstep.check_in(Op.STATE_DICT)
    device = rt.device if where == "device" else torch.device("cpu")
    for c in rt.chunks:
        part = c.shards.master[c.offset : c.offset + c.shard_numel] if c.spec.trainable else c.gather_source
        full = torch.empty(c.spec.numel, dtype=part.dtype, device=rt.device)
        rt.coll.shard_of(full).copy_(part)
        rt.coll.all_gather_(full)
        if where is None:
            continue
        for s in c.spec.slots:
            value = full[s.offset : s.offset + s.numel].view(rt.layout.params[s.param].shape)
            yield s.param, value.to(device=device, dtype=dtypes[s.param], copy=True)
