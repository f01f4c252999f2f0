"""The optimizer state by parameter name, independent of the chunk layout: what this rank holds of
each parameter, and filling this rank's shards from named flat pieces saved by any layout, rank
count or offload placement (or by a plain ``torch.optim.AdamW``).

A parameter's state is its fp32 ``master``, ``exp_avg`` and ``exp_avg_sq``, each seen as the
flattened parameter (``numel`` elements), and its own Adam ``step``. Chunks never split a parameter
and a rank's shard of a chunk is contiguous, so a rank holds one contiguous flat range
``[start, end)`` of a parameter, or none of it. Tied weights are one parameter, named by their first
name in ``model.named_parameters()`` (the name ``save_pretrained`` keeps).

``Meta`` is the part every rank has whole (steps, groups, shapes, the loss scale): JSON, the same on
every rank. Loading checks everything against this run before the first element is copied, so a
state of another model or a partial one changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..chunk.store import shard_overlap
from ..runtime.chunk_runtime import ChunkState

if TYPE_CHECKING:
    from .optimizer import ElixirOptimizer

__all__ = ["KINDS", "Piece", "owned_pieces", "named_state", "named_meta", "load_named", "plain_to_named"]

KINDS = ("master", "exp_avg", "exp_avg_sq")

Reader = Callable[[str, str, int, int], "torch.Tensor | None"]
"""``read(name, kind, start, end)``: elements ``[start, end)`` of that flattened parameter's state,
or ``None`` to keep what the shard holds (a plain optimizer has no master: the weights are it)."""


@dataclass(frozen=True)
class Piece:
    """This rank's part ``[start, end)`` of parameter ``param`` (flat), at ``offset`` in ``chunk``'s arenas."""

    param: int
    name: str
    start: int
    end: int
    chunk: ChunkState
    offset: int


def owned_pieces(opt: ElixirOptimizer) -> list[Piece]:
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


def named_meta(opt: ElixirOptimizer) -> dict[str, Any]:
    """The rank-independent part: every trainable parameter's names, shape, group and step; the
    param groups' hyperparameters and members (by name, in the optimizer's order: a plain torch
    optimizer numbers its state in that order); the optimizer's step count and loss scale."""
    layout = opt.runtime.layout
    params = {
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
    return {"step": opt.step_count, "scaler": opt.scaler.state_dict(), "param_groups": groups, "params": params}


@torch.no_grad()
def named_state(opt: ElixirOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's pieces as ``{"{name}.{kind}": 1-D fp32 CPU tensor}`` and ``{name: [start, end]}``.
    Host shards are returned as views (no copy); waits for in-flight updates first."""
    opt.runtime.grads.wait_for_grads()
    tensors, table = {}, {}
    for p in owned_pieces(opt):
        for kind in KINDS:
            tensors[f"{p.name}.{kind}"] = getattr(p.chunk.shards, kind)[p.offset : p.offset + p.end - p.start].cpu()
        table[p.name] = [p.start, p.end]
    return tensors, table


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _check(opt: ElixirOptimizer, meta: dict[str, Any], where: str) -> dict[int, str]:
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
def load_named(opt: ElixirOptimizer, meta: dict[str, Any], read: Reader, where: str) -> None:
    """Fills this rank's shards, step counts, hyperparameters and loss scale from ``meta`` and
    ``read``; every check runs before the first copy (``ValueError`` naming ``where``)."""
    rt = opt.runtime
    names = _check(opt, meta, where)
    rt.grads.wait_for_grads()
    for p in owned_pieces(opt):
        for kind in KINDS:
            value = read(names[p.param], kind, p.start, p.end)
            if value is not None:
                getattr(p.chunk.shards, kind)[p.offset : p.offset + p.end - p.start].copy_(value)
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
    for i, key in names.items():
        opt.param_steps[i] = int(meta["params"][key]["step"])
    opt.step_count = int(meta["step"])
    opt.consecutive_skips = 0
    if meta.get("scaler") is not None:
        opt.scaler.load_state_dict(meta["scaler"])
    rt.reload_shards()


def plain_to_named(opt: ElixirOptimizer, state_dict: dict[str, Any], where: str) -> tuple[dict[str, Any], Reader]:
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
    params, by_key, missing = {}, {}, []
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
            params[name] = {"names": layout.names[i], "shape": shape, "group": gi, "step": int(_jsonable(step))}
            by_key[name] = state
    groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in saved_groups]
    steps = [e["step"] for e in params.values()]
    meta = {"step": max(steps, default=0), "scaler": None, "param_groups": groups, "params": params, "missing": missing}

    def read(name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        if kind == "master":
            return None
        value = by_key[name].get(kind)
        return torch.zeros(end - start) if value is None else value.reshape(-1)[start:end]

    return meta, read
