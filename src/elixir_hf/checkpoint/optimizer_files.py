"""The optimizer state's files in a checkpoint, saved and loaded: by parameter name (a
safetensors file per rank and a JSON index, loadable into any number of ranks, chunk layout or
offload placement), and a plain torch optimizer's ``state_dict()`` (the stock Trainer's
``optimizer.pt``, Accelerate's ``optimizer.bin``). The index's layout is in docs/hf.md, "Checkpoints"."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from elixir_runtime import (
    ElixirOptimizer,
    NamedMeta,
    Reader,
    load_named,
    named_meta,
    named_state,
    plain_to_named,
    saved_state,
)

from .format import (
    OPTIM_INDEX,
    PLAIN_OPTIMIZER_NAMES,
    CheckpointError,
    Digest,
    _error,
    _gather,
    _raise_any,
    all_ranks_agree,
    atomic_safetensors_save,
    atomic_write_text,
    confined,
    optimizer_format,
)
from .note import write_note

__all__ = ["save_optimizer", "load_optimizer", "read_optimizer_index", "optim_file_name"]

_OPTIM_FORMAT = "elixir-optimizer"
_OPTIM_VERSION = 1
"""The index's format version; a newer one is refused (``read_optimizer_index``)."""


def optim_file_name(rank: int, world_size: int) -> str:
    return f"optimizer-{rank:05d}-of-{world_size:05d}.safetensors"


def _elixir(optimizer: object) -> ElixirOptimizer:
    """The ``ElixirOptimizer`` under Accelerate's wrapper (the Trainer's ``self.optimizer``)."""
    return cast(ElixirOptimizer, getattr(optimizer, "elixir_optimizer", optimizer))


def save_optimizer(
    folder: str | os.PathLike[str],
    optimizer: object,
    *,
    rank: int,
    world_size: int,
    is_main: bool,
    global_step: int | None,
) -> dict[str, Digest]:
    """A collective: each rank writes the optimizer state it holds, by parameter name, into its own
    file, then the main process writes the index from every rank's piece table and the note for a
    reader without Elixir (``checkpoint/note.py``). Returns this
    rank's digests (for ``seal``); a failure on any rank is raised on every rank."""
    opt, folder = _elixir(optimizer), Path(folder)
    name = optim_file_name(rank, world_size)
    digests: dict[str, Digest] = {}

    def write() -> dict[str, list[int]]:
        tensors, table = named_state(opt)
        digests[name] = atomic_safetensors_save(tensors, folder / name, {"global_step": str(global_step)})
        return table

    table, error = _error(write)
    tables = _gather((table, error))  # also the barrier: every rank's file is in place
    _raise_any([e for _, e in tables], f"saving the optimizer state to {folder}")

    def index() -> None:
        doc: OptimizerIndex = {
            "format": _OPTIM_FORMAT,
            "version": _OPTIM_VERSION,
            "world_size": world_size,
            "global_step": global_step,
            **named_meta(opt),
        }
        for r, (pieces, _) in enumerate(tables):
            for param, (start, end) in pieces.items():
                doc["params"][param].setdefault("pieces", []).append((optim_file_name(r, world_size), start, end))
        digests[OPTIM_INDEX] = atomic_write_text(json.dumps(doc, indent=1), folder / OPTIM_INDEX)
        write_note(folder)

    error = _error(index)[1] if is_main else None
    all_ranks_agree(error, f"saving the optimizer state to {folder}")
    return digests


class OptimizerIndex(NamedMeta):
    """``OPTIM_INDEX``: ``named_meta`` with each parameter's pieces (``ParamEntry.pieces``), the format and the step."""

    format: str
    version: int
    world_size: int
    global_step: int | None


def read_optimizer_index(checkpoint: str | os.PathLike[str], global_step: int | None = None) -> OptimizerIndex:
    """The index of a named optimizer state, checked: a format this code reads, the checkpoint's
    step, and every parameter's pieces covering it whole (``CheckpointError`` naming the file)."""
    path = Path(checkpoint) / OPTIM_INDEX
    index: OptimizerIndex = json.loads(path.read_text())
    if index.get("format") != _OPTIM_FORMAT:
        raise CheckpointError(f"{path} is not an Elixir optimizer index (format {index.get('format')!r})")
    if int(index.get("version", 0)) > _OPTIM_VERSION:
        raise CheckpointError(
            f"{path} has format version {index['version']}, newer than this elixir-hf reads ({_OPTIM_VERSION}): "
            "upgrade elixir-hf to resume it"
        )
    if global_step is not None and index.get("global_step") != global_step:
        raise CheckpointError(
            f"{path} is stale: it holds step {index.get('global_step')} and the checkpoint step {global_step}"
        )
    for name, entry in index["params"].items():
        for file, _, _ in entry.get("pieces", []):
            if Path(confined(checkpoint, file, path)).parent != Path(checkpoint):
                raise CheckpointError(
                    f"{path} names the file {file!r} for {name!r}: optimizer files lie in {checkpoint}"
                )
        numel, at = math.prod(entry["shape"]), 0
        for _, start, end in sorted(entry.get("pieces", []), key=lambda p: p[1]):
            if start != at:
                break
            at = end
        if at != numel:
            raise CheckpointError(
                f"{path} is partial: the pieces of {name!r} cover its elements [0, {at}) of {numel} contiguously. "
                "Resume from another checkpoint"
            )
    return index


def load_optimizer(
    checkpoint: str | os.PathLike[str],
    optimizer: object,
    global_step: int | None = None,
    *,
    allow_missing: bool = False,
) -> None:
    """Loads the optimizer state of a verified checkpoint, in any format ``optimizer_format``
    knows, into this run's shards: each rank reads only the slices its shards hold. Nothing is
    loaded unless the whole state fits this model (``CheckpointError`` naming the file); a plain
    state without some trainable parameter's Adam state only with ``allow_missing``
    (``ElixirPlugin.allow_missing_adam_state``)."""
    ckpt, opt = Path(checkpoint), _elixir(optimizer)
    fmt = optimizer_format(ckpt)
    if fmt == "plain":
        path = next(ckpt / n for n in PLAIN_OPTIMIZER_NAMES if (ckpt / n).is_file())
        plain = torch.load(path, map_location="cpu", weights_only=True)
        _check_plain(plain, path)
        meta, read = plain_to_named(opt, plain, str(path))
        if meta["missing"] and not allow_missing:
            raise CheckpointError(_missing_state(path, meta["missing"]))
        return _load_named(opt, meta, read, path)
    if fmt is None:
        raise CheckpointError(f"{ckpt} holds no optimizer state ({OPTIM_INDEX} is missing)")
    index = read_optimizer_index(ckpt, global_step)
    with contextlib.ExitStack() as files:
        opened = {}
        for file in sorted({p[0] for e in index["params"].values() for p in e["pieces"]}):
            if not (ckpt / file).is_file():  # another node's, on node-local disks: an error only if read
                continue
            opened[file] = files.enter_context(safe_open(str(ckpt / file), framework="pt"))  # the header only
            saved = opened[file].metadata().get("global_step")
            if saved != str(index["global_step"]):
                raise CheckpointError(
                    f"{ckpt / file} is stale: it holds step {saved} and the checkpoint step {index['global_step']}"
                )

        stored = saved_state(index)

        def read(name: str, kind: str, start: int, end: int) -> torch.Tensor:
            t = stored.tensor(kind)
            want = t.span(start, end)
            out = torch.empty(want.stop - want.start, dtype=t.dtype)
            for file, a, b in index["params"][name]["pieces"]:
                lo, hi = max(a, start), min(b, end)
                if lo < hi and file not in opened:
                    raise CheckpointError(
                        f"{ckpt / file} is missing, and this rank needs its part of {name!r}. With a disk per node "
                        "(save_on_each_node) each node holds its own ranks' files: resume with the same ranks on "
                        "each node, or copy every node's optimizer-*.safetensors into the checkpoint"
                    )
                if lo < hi:  # pieces and reads start at block boundaries: entries map like elements
                    got, base = t.span(lo, hi), t.span(a, a).start
                    value = opened[file].get_slice(f"{name}.{kind}")[got.start - base : got.stop - base]
                    out[got.start - want.start : got.stop - want.start] = value
            return out

        _load_named(opt, index, read, ckpt / OPTIM_INDEX)


_ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


def _check_plain(plain: object, path: Path) -> None:
    """Each parameter's entry of a plain Adam state holds every field, or none (a parameter without
    state: ``_missing_state``); a partial one is refused, as torch's Adam refuses it at its next step,
    rather than loaded with zeros for what is missing."""
    state = plain.get("state") if isinstance(plain, dict) else None
    for key, entry in (state or {}).items():
        lacks = [f for f in _ADAM_FIELDS if f not in entry] if isinstance(entry, dict) and entry else []
        if lacks:
            raise CheckpointError(
                f"{path}: the Adam state of parameter number {key} lacks {', '.join(map(repr, lacks))} (it holds "
                f"{sorted(entry)}): an Adam state is step, exp_avg and exp_avg_sq together. Resume from the "
                "checkpoint it was made from, or convert it again"
            )


def _missing_state(path: Path, names: list[str]) -> str:
    return (
        f"{path} holds no Adam state for {len(names)} trainable parameter(s) ({', '.join(map(repr, names[:5]))}"
        f"{', ...' if len(names) > 5 else ''}): loading it would restart Adam for them (step 0, zero moments) "
        "while the others continue. If they never had a gradient in the run that saved it (torch keeps no state "
        "for such a parameter: a module the forward does not use), resume with --elixir "
        "'{\"allow_missing_adam_state\": true}' (beside your other keys) and they start as torch would start "
        "them; if their state was lost (a conversion that dropped it), resume from the checkpoint it was made from"
    )


def _load_named(opt: ElixirOptimizer, meta: NamedMeta, read: Reader, path: Path) -> None:
    try:
        load_named(opt, meta, read, str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from e
