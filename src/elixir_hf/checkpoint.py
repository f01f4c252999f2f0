"""Checkpoint files of an Elixir run, written so that a resume can trust them, and the checks
that make a bad resume fail early, on every rank, naming the file.

Layout of a checkpoint folder (on top of what the Trainer writes):

* ``model.safetensors`` (+ config): consolidated, loadable by ``from_pretrained``;
* ``elixir_optim_rank{r}.pt``: rank ``r``'s optimizer shard (master weights, Adam moments,
  loss scale, the Trainer's ``global_step``), written by every rank;
* ``elixir_plan.json``: the plan the run used (see ``plugin.py`` for reusing it);
* ``elixir_checkpoint.json``, the marker, written last: the step, the number of ranks and the size
  and CRC-32 of every other file. A folder without it is torn (a save was interrupted).

Every file this package writes goes to a temporary name in the same folder, is fsynced, renamed
into place and the folder fsynced; on any error the temporary file is removed and the error
names the path and the OS error. Files other code writes (the Trainer's ``trainer_state.json``
and RNG states, Accelerate's) are fsynced and summed when the marker is written. CRC-32 (zlib),
not SHA-256: faster (docs/hf.md, "Checkpoints"), and the marker guards against torn, truncated
and swapped files, not against an adversary.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from elixir_runtime.progress import Bar, progress

__all__ = [
    "MARKER_NAME",
    "PLAN_NAME",
    "CheckpointError",
    "shard_name",
    "atomic_torch_save",
    "atomic_write_text",
    "staged_dir",
    "unmark",
    "seal",
    "verify",
    "checkpoint_folders",
    "newest_complete",
    "all_ranks_agree",
    "saved_world_size",
    "check_resume",
    "load_shard",
]

logger = logging.getLogger(__name__)

PLAN_NAME = "elixir_plan.json"
MARKER_NAME = "elixir_checkpoint.json"
_MARKER_FORMAT = "elixir-checkpoint/1"
_SHARD_RE = re.compile(r"^elixir_optim_rank(\d+)\.pt$")
_BLOCK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or trusted; raised on every rank."""


def shard_name(rank: int) -> str:
    return f"elixir_optim_rank{rank}.pt"


class _Summing:
    """The file object ``write`` sees: sums what passes and keeps the first OS error, which
    ``torch.save``'s C++ writer would turn into ``basic_ios::clear: iostream error``. ``bar``
    counts the bytes."""

    def __init__(self, f: BinaryIO, bar: Bar) -> None:
        self.f, self.crc, self.bytes, self.error, self.bar = f, 0, 0, None, bar

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.crc = zlib.crc32(data, self.crc)
        size = len(memoryview(data).cast("B"))
        self.bytes += size
        self.bar.update(size)
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_file(path: str | os.PathLike, write: Callable[[_Summing], None]) -> dict[str, int]:
    """``write(f)`` into ``path`` atomically and durably; returns its size and CRC-32."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    out = None
    try:
        with open(tmp, "wb") as f, progress(None, f"elixir: writing {path.name}", unit="B") as bar:
            out = _Summing(f, bar)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = out.error if out is not None and out.error is not None else e
        if isinstance(cause, OSError):
            raise OSError(
                cause.errno or errno.EIO,
                f"{cause.strerror or cause} (writing checkpoint file {path}; the partial file was removed)",
                str(path),
            ) from e
        raise
    return {"bytes": out.bytes, "crc32": out.crc}


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> dict[str, int]:
    return _write_file(path, lambda f: torch.save(obj, f))


def atomic_write_text(text: str, path: str | os.PathLike) -> dict[str, int]:
    return _write_file(path, lambda f: f.write(text.encode()))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sum_file(path: Path, bar: Bar, fsync: bool = False) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc, size = zlib.crc32(block, crc), size + len(block)
            bar.update(len(block))
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": size, "crc32": crc}


@contextlib.contextmanager
def staged_dir(output_dir: str | os.PathLike) -> Iterator[str]:
    """Yields a fresh folder next to ``output_dir``; on success its files (fsynced) replace those
    in it and the folder is fsynced.

    Weight files of an earlier save that the new save does not write (another shard count) are
    removed, so ``from_pretrained`` never mixes two saves.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".elixir-save-", dir=out))
    try:
        yield str(stage)
        new = {p.name for p in stage.iterdir()}
        for item in stage.iterdir():
            with open(item, "rb") as f:
                os.fsync(f.fileno())
        for old in out.glob("model*.safetensors*"):
            if old.name not in new:
                old.unlink()
        for item in stage.iterdir():
            os.replace(item, out / item.name)
        _fsync_dir(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------------------------- the marker
def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective when distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_ranks_agree(error: str | None, what: str) -> None:
    """A collective: raises ``CheckpointError`` on every rank when any rank reports an error, so
    that no rank goes on alone into a collective the failed one never joins (a hang until the
    process-group timeout, 30 minutes by default)."""
    errors = [f"rank {r}: {e}" for r, e in enumerate(_gather(error)) if e is not None]
    if errors:
        raise CheckpointError(f"{what} failed:\n  " + "\n  ".join(errors))


def _error(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by all_ranks_agree
        return None, f"{type(e).__name__}: {e}"


def unmark(folder: str | os.PathLike) -> None:
    """Before saving into ``folder`` again: it is torn until ``seal`` marks it (rank 0)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / MARKER_NAME).unlink()


def seal(
    folder: str | os.PathLike, digests: dict[str, dict[str, int]], *, step: int | None, optimizer: bool, is_main: bool
) -> None:
    """A collective, once every rank has written its files into ``folder``: the main process sums
    (and fsyncs) the files no rank summed while writing (``digests``: this rank's) and writes the
    marker last. Any rank's failure is raised on every rank."""
    everyone: dict[str, dict[str, int]] = {}
    ranks = _gather(digests)  # also the barrier: every rank's files are in place
    for d in ranks:
        everyone.update(d)
    error = None
    if is_main:
        folder = Path(folder)

        def write() -> None:
            paths = {}
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(folder).as_posix()
                if p.is_file() and rel != MARKER_NAME and not any(s.startswith(".") for s in rel.split("/")):
                    paths[rel] = p
            todo = sum(p.stat().st_size for rel, p in paths.items() if not everyone.get(rel))
            with progress(todo, "elixir: summing the checkpoint's files", unit="B") as bar:
                files = {rel: everyone.get(rel) or _sum_file(p, bar, fsync=True) for rel, p in paths.items()}
            marker = {
                "format": _MARKER_FORMAT,
                "step": step,
                "optimizer": optimizer,
                "world_size": len(ranks) if optimizer else None,
                "files": files,
            }
            atomic_write_text(json.dumps(marker, indent=1), folder / MARKER_NAME)

        _, error = _error(write)
    all_ranks_agree(error, f"sealing checkpoint {folder}")


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(folder) / MARKER_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def verify(folder: str | os.PathLike, rank: int, is_main: bool) -> dict[str, Any]:
    """A collective before anything is loaded: ``folder`` has its marker and every file matches the
    size and CRC-32 recorded at save (each rank reads its own shard, the main process the rest).
    Returns the marker; raises ``CheckpointError`` on every rank naming each bad file."""
    folder = Path(folder)

    def check() -> dict[str, Any]:
        marker = read_marker(folder)
        if marker is None:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: it has no {MARKER_NAME}, which a save writes last (the save was "
                "interrupted, or the folder was not written by Elixir). Resume from an earlier checkpoint; "
                "resume_from_checkpoint=True picks the newest complete one"
            )
        bad = []
        mine = {
            name: want
            for name, want in marker["files"].items()
            if ((int(m.group(1)) == rank) if (m := _SHARD_RE.match(name)) else is_main)
        }
        with progress(sum(w["bytes"] for w in mine.values()), "elixir: verifying the checkpoint", unit="B") as bar:
            for name, want in mine.items():
                bad += _check_file(folder / name, want, bar)
        if bad:
            raise CheckpointError("; ".join(bad) + ". Resume from another checkpoint")
        return marker

    marker, error = _error(check)
    all_ranks_agree(error, f"verifying checkpoint {folder}")
    seen = _gather((str(folder), marker["step"]))  # node-local disks: each rank reads its node's folder
    if len({step for _, step in seen}) > 1:
        raise CheckpointError(
            "the ranks would resume from different steps: "
            + "; ".join(f"rank {r}: {f} (step {step})" for r, (f, step) in enumerate(seen))
            + ". Each node picked its own newest complete checkpoint (a save completed on some nodes only): "
            "pass resume_from_checkpoint=<output_dir>/checkpoint-N with a step every node has"
        )
    return marker


def _check_file(path: Path, want: dict[str, int], bar: Bar) -> list[str]:
    """What is wrong with ``path`` against its marker entry ``want``: nothing, or one message."""
    if not path.is_file():
        return [f"{path} is missing"]
    got = _sum_file(path, bar)
    if got["bytes"] != want["bytes"]:
        return [f"{path} is truncated or overwritten: {got['bytes']} bytes, {want['bytes']} at save"]
    if got["crc32"] != want["crc32"]:
        return [f"{path} is corrupt or from another checkpoint: its CRC-32 differs from the one saved"]
    return []


def checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir`` (the Trainer's names), newest first."""
    folders = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name[11:].isdigit()]
    return sorted(folders, key=lambda p: int(p.name[11:]), reverse=True)


def newest_complete(output_dir: str | os.PathLike, required: bool = True) -> str | None:
    """``resume_from_checkpoint=True``: the newest ``checkpoint-N`` with its marker; warns about
    each newer torn one (a save interrupted by a crash) it passes over. None complete: an error, or
    ``None`` (and the warning) when not ``required``."""
    torn = []
    for p in checkpoint_folders(output_dir):
        if (p / MARKER_NAME).is_file():
            break
        torn.append(p)
    else:
        p = None
    if torn and (p is not None or not required):
        logger.warning(
            "skipping torn checkpoint(s) %s (no %s: a save was interrupted); %s",
            ", ".join(map(str, torn)),
            MARKER_NAME,
            f"resuming from {p}" if p is not None else "no complete checkpoint is left to resume from",
        )
    if p is None and required:
        raise CheckpointError(
            f"no complete checkpoint in {output_dir} to resume from"
            + (f" (torn, without {MARKER_NAME}: {', '.join(map(str, torn))})" if torn else "")
            + ": start without resume_from_checkpoint, or pass a checkpoint folder"
        )
    return str(p) if p is not None else None


def saved_world_size(checkpoint: str | os.PathLike) -> int | None:
    """Number of ranks that wrote optimizer shards into ``checkpoint`` (``None``: no shards)."""
    marker = read_marker(checkpoint)
    if marker is not None and marker["world_size"] is not None:
        return int(marker["world_size"])
    plan = Path(checkpoint) / PLAN_NAME
    if plan.is_file():
        return int(json.loads(plan.read_text())["world_size"])
    ranks = [int(m.group(1)) for p in Path(checkpoint).iterdir() if (m := _SHARD_RE.match(p.name))]
    return max(ranks) + 1 if ranks else None


def check_resume(
    checkpoint: str | os.PathLike, model: nn.Module, world_size: int, rank: int, is_main: bool
) -> dict[str, Any]:
    """Fails before any weight is loaded, on every rank, when the checkpoint cannot continue this
    run (another number of ranks, a plain PyTorch optimizer, a bad file, another model); returns
    its marker."""
    ckpt = Path(checkpoint)
    saved = saved_world_size(ckpt)
    if saved is not None and saved != world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {saved} rank(s) (one optimizer shard each) and this run has "
            f"{world_size}: resume with {saved} processes (torchrun --nproc_per_node {saved} / accelerate launch "
            f"--num_processes {saved}), or start a new run from its weights with --model_name_or_path {ckpt}"
        )
    if saved is None and (ckpt / "optimizer.pt").is_file():
        raise ValueError(
            f"checkpoint {ckpt} holds a plain PyTorch optimizer state (optimizer.pt), not Elixir shards: resume it "
            f"with --elixir off, or start an Elixir run from its weights with --model_name_or_path {ckpt}"
        )
    marker = verify(ckpt, rank, is_main)
    _check_weights_match(ckpt, model)
    return marker


def _check_weights_match(ckpt: Path, model: nn.Module) -> None:
    shapes = _checkpoint_shapes(ckpt)
    if shapes is None:
        return
    mismatched, missing = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in shapes:
            seen.add(id(p))
            if list(shapes[name]) != list(p.shape):
                mismatched.append(f"{name!r} is {list(shapes[name])} there, {list(p.shape)} here")
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:  # a tied weight counts as present under any of its names
            missing.append(name)
            seen.add(id(p))
    if mismatched or missing:
        examples = mismatched[:2] + [f"{n!r} is missing" for n in missing[:2]]
        raise ValueError(
            f"checkpoint {ckpt} is from another model: {len(mismatched)} weight(s) differ in shape and "
            f"{len(missing)} are missing ({'; '.join(examples)}). Resume with the model it was saved from, or "
            "start a new run"
        )


def _checkpoint_shapes(ckpt: Path) -> dict[str, list[int]] | None:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as st:
            for key in st.keys():
                shapes[key] = st.get_slice(key).get_shape()
    return shapes


def load_shard(checkpoint: str | os.PathLike, rank: int, optimizer: Any, global_step: int | None = None) -> None:
    """Loads rank ``rank``'s shard of a verified checkpoint into ``optimizer``; a shard of another
    step (``global_step``: the Trainer's, saved in the shard) or layout fails naming the file."""
    path = Path(checkpoint) / shard_name(rank)
    shard = torch.load(path, map_location="cpu", weights_only=True)
    saved = shard.pop("global_step", None)
    if global_step is not None and saved != global_step:
        raise CheckpointError(f"{path} is stale: it holds step {saved} and the checkpoint step {global_step}")
    try:
        optimizer.load_state_dict(shard)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} does not fit this run: {e}") from e
