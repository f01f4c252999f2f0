"""Weights streamed from safetensors files straight into chunk shards.

A model built on the ``meta`` device on every rank carries a ``StreamedWeights``
(``stream_weights``): for each parameter, the file and key that hold its value. ``prepare`` fills
each rank's shards from it, reading only the elements that rank's shards hold, one slot's part at
a time (``read``): a rank never holds more than one chunk shard's worth of weights besides its
arenas, and no rank reads the whole model. Files are memory-mapped (safetensors' default): a read
is a view of the page cache, copied into the arenas; its pages are file-backed, which the host
counts as available (``host.py``), and are unmapped when the fill closes the files. (safetensors'
``pread`` backend reads row blocks far slower: docs/runtime.md.)

A checkpoint folder is what ``save_pretrained`` writes: ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. Every file is opened (its header checked against its size, so a
truncated file is refused) and every parameter's key and shape checked when the source is made,
before any memory is allocated.

[Note: reading a flattened range]
A shard holds a contiguous range of a parameter's flattened elements. ``pieces`` splits such a
range of a row-major tensor into at most ``2 * ndim - 1`` rectangular blocks (a partial leading
row, whole rows, a partial trailing row, recursively), each one ``get_slice`` read; their
flattened concatenation is the range exactly, so nothing outside it is read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .attached import attach_weights

if TYPE_CHECKING:
    from safetensors import safe_open

__all__ = ["CheckpointFiles", "StreamedWeights", "TensorEntry", "WeightsError", "pieces", "stream_weights"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ValueError):
    """A checkpoint folder that cannot fill the model: a file missing or truncated, a key or shape wrong."""


@dataclass(frozen=True)
class TensorEntry:
    path: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    """The safetensors dtype name (``F32``, ``BF16``, ...)."""


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class CheckpointFiles:
    """The tensors of a safetensors checkpoint folder, read from the headers only."""

    folder: str
    entries: dict[str, TensorEntry]
    sizes: dict[str, int]
    """Each file's size in bytes when its header was read (``check`` compares)."""

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> CheckpointFiles:
        """Reads the index (if sharded) and every file's header; raises ``WeightsError`` naming the file and the fix."""
        from safetensors import SafetensorError, safe_open

        root = Path(folder)
        index = root / INDEX_FILE
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise WeightsError(
                    f"{index} is not a safetensors index ({e}): write it again with save_pretrained"
                ) from e
            files = sorted(set(weight_map.values()))
        elif (root / SINGLE_FILE).is_file():
            weight_map, files = {}, [SINGLE_FILE]
        else:
            raise WeightsError(
                f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE}: streaming reads the safetensors files that "
                "save_pretrained writes (save the model with safe_serialization, or load it without streaming)"
            )
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            keys = [k for k, f in weight_map.items() if f == absent[0]]
            raise WeightsError(
                f"{index} names {len(absent)} file(s) that are not in {root}: {absent[:3]} (e.g. {absent[0]} with "
                f"{len(keys)} tensors such as {keys[0]!r}): copy the whole checkpoint, every file its index lists"
            )
        entries: dict[str, TensorEntry] = {}
        sizes: dict[str, int] = {}
        for name in files:
            path = str(root / name)
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        entries[key] = TensorEntry(path, key, tuple(sl.get_shape()), sl.get_dtype())
            except SafetensorError as e:
                raise WeightsError(
                    f"{path} cannot be read as safetensors ({e}): the file is truncated or damaged; copy or download "
                    "it again"
                ) from e
            sizes[path] = os.path.getsize(path)
        listed = [k for k, f in weight_map.items() if k not in entries]
        if listed:
            raise WeightsError(
                f"{index} places {len(listed)} tensors in files that do not hold them (e.g. {listed[0]!r} in "
                f"{weight_map[listed[0]]}): the index and the files are from different saves; copy the checkpoint again"
            )
        return cls(str(root), entries, sizes)

    def check(self) -> str | None:
        """Why the files can no longer be read as they were when opened (missing, resized); None if they can."""
        for path, size in self.sizes.items():
            try:
                now = os.path.getsize(path)
            except OSError as e:
                return f"{path} cannot be read ({e}): the checkpoint's files must stay in place until training starts"
            if now != size:
                return f"{path} changed size since the model was loaded ({size} -> {now} bytes): copy it again"
        return None


@dataclass(eq=False)
class StreamedWeights:
    """Where each meta parameter's value is: ``entries[id(param)]``, read a flattened range at a time
    (an ``attached.AttachedWeights``)."""

    files: CheckpointFiles
    entries: dict[int, TensorEntry]
    params: list[nn.Parameter]
    """The parameters ``entries`` is keyed by (kept so their ids stay theirs)."""
    guard: RemovableHandle | None = None
    """The forward pre-hook that refuses to run the model before ``prepare`` filled its chunks."""
    _open: dict[str, safe_open] = field(default_factory=dict)

    fallback = "elixir_hf.from_pretrained(..., stream=False), or ELIXIR_STREAM=0 under elixir-run"

    @property
    def origin(self) -> str:
        return self.files.folder

    def covers(self, p: torch.Tensor) -> bool:
        return id(p) in self.entries

    def check(self) -> str | None:
        return self.files.check()

    def agreement(self) -> object:
        return None

    @torch.no_grad()
    def read(self, p: torch.Tensor, start: int, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``p``'s flattened value, in ``p``'s dtype (as
        ``from_pretrained`` casts a checkpoint tensor to the parameter's dtype), on the CPU."""
        if numel == 0:
            return torch.empty(0, dtype=p.dtype)
        entry = self.entries[id(p)]
        f = self._open.get(entry.path)
        if f is None:
            from safetensors import safe_open

            f = self._open[entry.path] = safe_open(entry.path, framework="pt", device="cpu")
        sl = f.get_slice(entry.key)
        parts: list[torch.Tensor]
        if not entry.shape:
            parts = [f.get_tensor(entry.key).reshape(1)]
        else:
            parts = [sl[idx].reshape(-1) for idx in pieces(entry.shape, start, start + numel)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.to(p.dtype)

    def close(self) -> None:
        """Closes the files ``read`` opened."""
        self._open.clear()


def pieces(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[slice, ...]]:
    """Index tuples of blocks of a row-major tensor of ``shape`` whose flattened concatenation is
    its elements ``[start, stop)`` (Note: reading a flattened range)."""
    if len(shape) == 1:
        return [(slice(start, stop),)]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        return [(slice(r0, r0 + 1), *p) for p in pieces(shape[1:], o0, o1)]
    out: list[tuple[slice, ...]] = []
    if o0:
        out += [(slice(r0, r0 + 1), *p) for p in pieces(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append((slice(r0, r1),))
    if o1:
        out += [(slice(r1, r1 + 1), *p) for p in pieces(shape[1:], 0, o1)]
    return out


def stream_weights(
    model: nn.Module, folder: str | os.PathLike[str] | CheckpointFiles, keys: Mapping[str, str] | None = None
) -> StreamedWeights:
    """Marks ``model``'s meta parameters as read from ``folder`` by ``prepare``; returns the source.

    ``keys`` maps a parameter name (any of a tied parameter's names) to its key in the files;
    by default a parameter's key is its name. Each parameter takes the first of its names that
    has a key in the files (a tied pair saved once needs one). Parameters that are not on meta
    keep their own values. Raises ``WeightsError`` before anything is read: a parameter with no
    key, a shape that differs from the file's, a dtype that is not a float.
    """
    files = folder if isinstance(folder, CheckpointFiles) else CheckpointFiles.open(folder)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
    entries: dict[int, TensorEntry] = {}
    missing: list[str] = []
    for pid, all_names in names.items():
        key = next((k for k in _keys(all_names, keys) if k in files.entries), None)
        if key is None:
            missing.append(" = ".join(all_names))
            continue
        entry, p = files.entries[key], params[pid]
        if entry.shape != tuple(p.shape):
            raise WeightsError(
                f"size mismatch for {all_names[0]}: {entry.path} holds {key!r} with shape {entry.shape}, the model "
                f"built from the config has {tuple(p.shape)}: the config does not describe these weights (use the "
                "config.json saved with them)"
            )
        if entry.dtype not in _DTYPES:
            raise WeightsError(
                f"{entry.path} holds {key!r} as {entry.dtype}, not a float type: streaming reads unquantised "
                "weights; load this checkpoint without streaming"
            )
        entries[pid] = entry
    if missing:
        raise WeightsError(
            f"{len(missing)} parameters have no tensor in {files.folder} (e.g. {missing[:3]}): the checkpoint is "
            "incomplete or for another model; save it again with save_pretrained, or load without streaming to "
            "initialise the missing weights"
        )
    source = StreamedWeights(files, entries, list(params.values()))
    attach_weights(model, source)
    return source


def _keys(names: Iterable[str], keys: Mapping[str, str] | None) -> Iterable[str]:
    return (keys.get(n, n) for n in names) if keys is not None else names
