"""The optimizer state by parameter name, independent of the chunk layout: what this rank holds of
each parameter, and filling this rank's shards from named flat pieces saved by any layout, rank
count or offload placement (or by a plain ``torch.optim.AdamW``).

A parameter's state is the tensors of ``adam_state.py`` (its fp32 ``master`` and the moments: fp32
``exp_avg`` and ``exp_avg_sq``, or their 8-bit codes and ``.absmax`` block scales), each seen as the
flattened parameter (``numel`` elements; a scale per ``QUANT_BLOCK`` of them), and its own Adam
``step``. A state of the other kind of moments loads converted (dequantized or quantized, logged);
one of the same kind is copied as it is, bit for bit: 8-bit blocks are counted from each
parameter's first element in every layout ([Note: 8-bit moments]). Chunks never split a parameter
and a rank's shard of a chunk is contiguous, so a rank holds one contiguous flat range
``[start, end)`` of a parameter, or none of it. Tied weights are one parameter, named by their first
name in ``model.named_parameters()`` (the name ``save_pretrained`` keeps).

``Meta`` is the part every rank has whole (steps, groups, shapes, the loss scale): JSON, the same on
every rank. Loading checks everything against this run before the first element is copied, so a
state of another model or a partial one changes nothing.

``ElixirOptimizer.state_dict()`` is this format in memory (``state_dict``): the meta, and this
rank's pieces with their ranges. The per-rank chunk shards that ``state_dict()`` returned up to
elixir-hf 0.1.0 are refused by their format's name (``load_state_dict``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, TypeGuard

import torch

from ..adam_state import AdamState, adam_state
from ..chunk.store import shard_overlap
from ..kernels import quant8
from ..runtime.chunk_runtime import ChunkRuntime, ChunkState
from .loss_scaler import LossScaler

__all__ = [
    "STATE_FORMAT",
    "NamedMeta",
    "ParamEntry",
    "saved_state",
    "Piece",
    "owned_pieces",
    "named_state",
    "named_meta",
    "load_named",
    "plain_to_named",
    "state_dict",
    "load_state_dict",
]

logger = logging.getLogger(__name__)

STATE_FORMAT = "elixir-optimizer-state/1"
"""``ElixirOptimizer.state_dict()``'s format: ``named_meta`` and this rank's pieces by name."""
SHARD_FORMAT = "elixir-optimizer-shard/1"
"""The per-rank chunk shard ``state_dict()`` returned up to elixir-hf 0.1.0: refused by name."""


class ParamEntry(TypedDict):
    """A trainable parameter's entry of ``NamedMeta.params`` (keyed by its first name)."""

    names: list[str]
    """Every name of the parameter (tied weights have several)."""
    shape: list[int]
    group: int
    """Its param group's position."""
    step: int
    pieces: NotRequired[list[tuple[str, int, int]]]
    """The optimizer index's (``elixir_hf``'s checkpoints): ``(file, start, end)``, each rank's piece of it."""


class NamedMeta(TypedDict):
    """The rank-independent part of a named optimizer state (``named_meta``, ``plain_to_named``)."""

    step: int
    scaler: dict[str, float] | None
    moments: NotRequired[str]
    """How the moments are stored (``AdamState.moments``); absent: exact (older files, plain torch optimizers)."""
    param_groups: list[dict[str, Any]]
    """Each group's hyperparameters (JSON values: a loader reads them as it knows them) and ``params``, its
    members' names."""
    params: dict[str, ParamEntry]
    missing: NotRequired[list[str]]
    """``plain_to_named``'s: the trainable parameters the plain state has no entry for."""


class _NamedState(NamedMeta):
    """``state_dict()``: ``named_meta`` and this rank's pieces."""

    format: str
    rank: int
    world_size: int
    pieces: dict[str, list[int]]
    tensors: dict[str, torch.Tensor]


class OptimizerView(Protocol):
    """What this module reads and sets of an ``ElixirOptimizer`` (``optimizer.py``, which imports it)."""

    runtime: ChunkRuntime
    param_groups: list[dict[str, Any]]
    scaler: LossScaler
    step_count: int
    param_steps: list[int]
    consecutive_skips: int


Reader = Callable[[str, str, int, int], "torch.Tensor | None"]
"""``read(name, kind, start, end)``: the entries of that parameter's state ``kind`` that hold its
flattened elements ``[start, end)`` (``StateTensor.span``: a scale per block), or ``None`` to keep
what the shard holds (a plain optimizer has no master: the weights are it)."""


def saved_state(meta: NamedMeta) -> AdamState:
    """The state a saved meta's moments are stored as (exact where it does not say: older files,
    plain torch optimizers)."""
    return adam_state(meta.get("moments", "fp32"))


@dataclass(frozen=True)
class Piece:
    """This rank's part ``[start, end)`` of parameter ``param`` (flat), at ``offset`` in ``chunk``'s arenas."""

    param: int
    name: str
    start: int
    end: int
    chunk: ChunkState
    offset: int


def owned_pieces(opt: OptimizerView) -> list[Piece]:
    """What this rank holds of each trainable parameter, in arena order."""
    rt = opt.runtime
    layout = rt.layout
    out = []
    for c in rt.trainable:
        for slot in c.spec.slots:
            part = shard_overlap(layout, c.spec, slot, rt.coll.rank)
            if part is not None:
                shard_off, param_off, n = part
                name = layout.names[slot.param][0]
                out.append(Piece(slot.param, name, param_off, param_off + n, c, c.offset + shard_off))
    return out


def named_meta(opt: OptimizerView) -> NamedMeta:
    """The rank-independent part: every trainable parameter's names, shape, group and step; the
    param groups' hyperparameters and members (by name, in the optimizer's order: a plain torch
    optimizer numbers its state in that order); the optimizer's step count and loss scale."""
    layout = opt.runtime.layout
    params: dict[str, ParamEntry] = {
        layout.names[i][0]: {
            "names": layout.names[i],
            "shape": list(layout.params[i].shape),
            "group": layout.groups[i],
            "step": opt.param_steps[i],
        }
        for i in opt.runtime.grads.trainable_params
    }
    index = {id(p): i for i, p in enumerate(layout.params)}
    groups = [
        {
            **{k: _jsonable(v) for k, v in g.items() if k != "params"},
            "params": [layout.names[index[id(p)]][0] for p in g["params"]],
        }
        for g in opt.param_groups
    ]
    return {
        "step": opt.step_count,
        "scaler": opt.scaler.state_dict(),
        "moments": opt.runtime.ctx.state.moments,
        "param_groups": groups,
        "params": params,
    }


@torch.no_grad()
def named_state(opt: OptimizerView) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's pieces as ``{"{name}.{kind}": 1-D CPU tensor}`` (every kind of the run's state) and
    ``{name: [start, end]}``. Host shards are returned as views (no copy); waits for in-flight updates first."""
    opt.runtime.grads.wait_for_grads()
    tensors, table = {}, {}
    for p in owned_pieces(opt):
        for t, value in p.chunk.shards.state.range(p.offset, p.offset + p.end - p.start).items():
            tensors[f"{p.name}.{t.kind}"] = value.cpu()
        table[p.name] = [p.start, p.end]
    return tensors, table


def _jsonable(v: object) -> object:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _check(opt: OptimizerView, meta: NamedMeta, where: str) -> dict[int, str]:
    """``{param: saved name}`` for every trainable parameter; raises ``ValueError`` naming the first
    mismatches (``where``: the source, in the message) when ``meta`` is not a state of this model."""
    layout = opt.runtime.layout
    saved = meta["params"]
    alias = {n: key for key, entry in saved.items() for n in entry.get("names", [key])}
    found, missing, shapes, groups = {}, [], [], []
    for i in opt.runtime.grads.trainable_params:
        key = next((alias[n] for n in layout.names[i] if n in alias), None)
        if key is None:
            missing.append(layout.names[i][0])
            continue
        found[i] = key
        if list(saved[key]["shape"]) != list(layout.params[i].shape):
            shapes.append(f"{key!r} is {list(saved[key]['shape'])} there, {list(layout.params[i].shape)} here")
        elif int(saved[key]["group"]) != layout.groups[i]:
            groups.append(f"{key!r} is in param group {saved[key]['group']} there, {layout.groups[i]} here")
    unknown = sorted(set(saved) - set(found.values()))
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise ValueError(
            f"{where} has {len(meta['param_groups'])} param group(s) and this optimizer {len(opt.param_groups)}: "
            "build the optimizer with the same groups as the run that saved it"
        )
    if shapes or unknown:
        raise ValueError(
            f"{where} is from another model: {len(shapes)} parameter(s) differ in shape, {len(unknown)} are not "
            f"trainable parameters here ({'; '.join(shapes[:2] + [f'{n!r} is unknown' for n in unknown[:2]])}): "
            "resume with the model it was saved from, or start a new run from the weights only"
        )
    if missing:
        raise ValueError(
            f"{where} is partial: it has no optimizer state for {len(missing)} trainable parameter(s) "
            f"({', '.join(map(repr, missing[:3]))}). Resume from a complete checkpoint, or freeze those parameters"
        )
    if groups:
        raise ValueError(
            f"{where} groups the parameters differently ({'; '.join(groups[:2])}): build the optimizer's param "
            "groups as the run that saved it did"
        )
    return found


@torch.no_grad()
def load_named(opt: OptimizerView, meta: NamedMeta, read: Reader, where: str) -> None:
    """Fills this rank's shards, step counts, hyperparameters and loss scale from ``meta`` and
    ``read``; every check runs before the first copy (``ValueError`` naming ``where``)."""
    rt = opt.runtime
    names = _check(opt, meta, where)
    saved, state = saved_state(meta), rt.ctx.state
    if saved != state:
        logger.warning(
            "elixir: %s holds %s moments and this run keeps %s: %s on load",
            where,
            saved.moments,
            state.moments,
            "quantized block-wise to 8 bits" if state.quantized else "dequantized to fp32",
        )
    rt.grads.wait_for_grads()
    for p in owned_pieces(opt):
        here = p.chunk.shards.state.range(p.offset, p.offset + p.end - p.start)
        values = {kind: read(names[p.param], kind, p.start, p.end) for kind in saved.kinds}
        if saved != state:
            values = quant8.encode_state(state, {**quant8.decode_state(saved, values), "master": values["master"]})
        for kind, value in values.items():
            if value is not None:
                here[kind].copy_(value)
    for group, hypers in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in hypers.items() if k != "params"})
    for i, key in names.items():
        opt.param_steps[i] = int(meta["params"][key]["step"])
    opt.step_count = int(meta["step"])
    opt.consecutive_skips = 0
    scaler = meta.get("scaler")
    if scaler is not None:
        opt.scaler.load_state_dict(scaler)
    rt.reload_shards()


def plain_to_named(opt: OptimizerView, state_dict: dict[str, Any], where: str) -> tuple[NamedMeta, Reader]:
    """A plain ``torch.optim.Adam/AdamW`` ``state_dict()`` as ``(meta, read)`` for ``load_named``.

    Its parameters are numbered in its param groups' order, which this run's optimizer (built from
    the same model with the same groups, as the stock Trainer does) repeats: position → parameter →
    name. A trainable parameter without state gets step 0 and zero moments (torch's own start for a
    parameter that never had a gradient) and is listed in ``meta["missing"]``: whether that may load
    is the caller's decision (the state may also have been lost). The master stays what the shards
    hold: the weights, loaded with the model."""
    layout = opt.runtime.layout
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or "state" not in state_dict:
        raise ValueError(f"{where} is not a torch optimizer state_dict (no 'state' and 'param_groups')")
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(
            f"{where} has param groups of {[len(g['params']) for g in saved_groups]} parameter(s), this optimizer "
            f"{[len(g['params']) for g in opt.param_groups]}: it is from another model, or its optimizer was "
            "built with other groups"
        )
    index = {id(p): i for i, p in enumerate(layout.params)}
    params: dict[str, ParamEntry] = {}
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    missing: list[str] = []
    for gi, (saved, mine) in enumerate(zip(saved_groups, opt.param_groups)):
        for key, p in zip(saved["params"], mine["params"]):
            i = index.get(id(p))
            if i is None or layout.groups[i] < 0:
                continue  # frozen: no optimizer state
            name = layout.names[i][0]
            state = state_dict["state"].get(key, {})
            if not state:
                missing.append(name)
            shape = list(layout.params[i].shape)
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind in state and list(state[kind].shape) != shape:
                    raise ValueError(
                        f"{where} is from another model: the {kind} of parameter {name!r} (number {key}) is "
                        f"{list(state[kind].shape)}, the parameter here {shape}"
                    )
            step = state.get("step", 0)
            params[name] = {"names": layout.names[i], "shape": shape, "group": gi, "step": int(step)}
            by_key[name] = state
    groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in saved_groups]
    steps = [e["step"] for e in params.values()]
    meta: NamedMeta = {
        "step": max(steps, default=0),
        "scaler": None,
        "param_groups": groups,
        "params": params,
        "missing": missing,
    }

    def read(name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        if kind == "master":
            return None
        value = by_key[name].get(kind)
        return torch.zeros(end - start) if value is None else value.reshape(-1)[start:end].to(torch.float32)

    return meta, read


def state_dict(opt: OptimizerView) -> dict[str, Any]:
    """``ElixirOptimizer.state_dict()``: ``named_meta``, this rank's pieces (``{name: [start, end]}``)
    and their tensors (``{"{name}.{kind}": 1-D fp32 CPU copy}``), the rank and the number of ranks."""
    tensors, pieces = named_state(opt)
    return {
        "format": STATE_FORMAT,
        "rank": opt.runtime.coll.rank,
        "world_size": opt.runtime.coll.world_size,
        **named_meta(opt),
        "pieces": pieces,
        "tensors": {k: t.to("cpu", copy=True) for k, t in tensors.items()},
    }


def _is_named_state(saved: dict[str, Any]) -> TypeGuard[_NamedState]:
    """Whether ``saved`` says it is a ``state_dict()`` of this format."""
    return saved.get("format") == STATE_FORMAT


def load_state_dict(opt: OptimizerView, saved: dict[str, Any]) -> None:
    """``ElixirOptimizer.load_state_dict()``: a ``state_dict()`` of any layout, placement or rank count
    whose pieces hold what this rank holds (a one-rank state holds it all; each rank's own, on the
    same ranks and chunk size). Everything is checked before the first copy (``ValueError``)."""
    where = "the optimizer state_dict"
    fmt = saved.get("format")
    if fmt == SHARD_FORMAT:
        raise ValueError(
            f"{where} is a per-rank chunk shard (format {SHARD_FORMAT!r}), which ElixirOptimizer.state_dict() "
            "returned up to elixir-hf 0.1.0 and this version no longer reads. Load it with elixir-hf 0.1.0 "
            "(pip install elixir-hf==0.1.0), the last version that reads it, into the run that saved it, and save "
            "again by parameter name: a checkpoint of ElixirTrainer or ElixirAccelerator.save_state, which this "
            "version resumes on any number of ranks"
        )
    if not _is_named_state(saved):
        plain = "state" in saved and "param_groups" in saved
        raise ValueError(
            f"{where} is not an ElixirOptimizer state_dict (format {fmt!r}, expected {STATE_FORMAT!r})"
            + (
                ": it is a plain torch optimizer's; elixir_runtime.plain_to_named and load_named load that, "
                "by optimizer order (as elixir_hf resumes a stock Trainer's optimizer.pt)"
                if plain
                else ""
            )
        )
    names = _check(opt, saved, where)
    pieces = saved["pieces"]
    for p in owned_pieces(opt):
        start, end = pieces.get(names[p.param], (0, 0))
        if not start <= p.start < p.end <= end:
            raise ValueError(
                f"{where} holds elements [{start}, {end}) of {names[p.param]!r} (rank {saved['rank']} of "
                f"{saved['world_size']} saved it) and this rank ({opt.runtime.coll.rank} of "
                f"{opt.runtime.coll.world_size}) holds [{p.start}, {p.end}): a state_dict() holds its own rank's "
                "pieces, so load each rank's into the same rank, number of ranks and chunk size (one rank's holds "
                "everything); to change them, save a checkpoint by name (elixir_hf), which loads into any"
            )
    tensors: dict[str, torch.Tensor] = saved["tensors"]
    stored = saved_state(saved)

    def read(name: str, kind: str, start: int, end: int) -> torch.Tensor:
        t, first = stored.tensor(kind), pieces[name][0]
        here, base = t.span(start, end), t.span(first, first).start
        return tensors[f"{name}.{kind}"][here.start - base : here.stop - base]

    load_named(opt, saved, read, where)
