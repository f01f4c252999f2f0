"""Checkpoint files of an Elixir run, written so that a resume can trust them, and the checks
that make a bad resume fail early, on every rank, naming the file.

Layout of a checkpoint folder (on top of what the Trainer writes):

* ``model.safetensors`` (+ config): consolidated, loadable by ``from_pretrained``;
* ``optimizer-{r:05d}-of-{W:05d}.safetensors``: the optimizer state rank ``r`` of ``W`` holds, by
  parameter name (``{name}.master``, ``.exp_avg``, ``.exp_avg_sq``: 1-D pieces of the flattened
  parameter), written by every rank in parallel, and ``optimizer.safetensors.index.json``, written
  by the main process: each parameter's pieces (file, flat start, end), shape, group and step, the
  param groups, the loss scale, the Trainer's ``global_step`` and the format version. Any run loads
  it, whatever its number of ranks, chunk layout or offload placement (``load_optimizer``);
* ``elixir_optim_rank{r}.pt``: the per-rank chunk shards that versions before 0.1.0 wrote; refused,
  naming the version that reads them (``optimizer_format``);
* ``elixir_plan.json``: the plan the run used (see ``elixir_hf/plugin.py`` for reusing it);
* ``OPTIMIZER_README.md``: for a reader without Elixir, where the optimizer state is and how to
  convert it (``checkpoint/note.py``; not summed: a reader may edit or delete it);
* ``elixir_checkpoint.json``, the marker, written last: the step, the number of ranks and the size
  and CRC-32 of every other file. A folder without it is torn (a save was interrupted).

Every file this package writes goes to a temporary name in the same folder (``.NAME.tmp<pid>``,
created with ``O_EXCL | O_NOFOLLOW``: never written through a link planted there), is fsynced,
renamed into place and the folder fsynced; on any error the temporary file is removed and the error
names the path and the OS error; what a kill leaves is swept by the next job
(``folder_lock.sweep``). Files other code writes (the Trainer's ``trainer_state.json``
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
from typing import Any, BinaryIO, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from elixir_runtime.progress import Bar, progress

__all__ = [
    "MARKER_NAME",
    "NOTE_NAME",
    "PLAN_NAME",
    "CheckpointError",
    "Digest",
    "Marker",
    "atomic_torch_save",
    "atomic_write_text",
    "staged_dir",
    "confined",
    "read_marker",
    "unmark",
    "seal",
    "verify",
    "checkpoint_folders",
    "newest_complete",
    "all_ranks_agree",
    "check_resume",
    "OPTIM_INDEX",
    "PLAIN_OPTIMIZER_NAMES",
    "atomic_safetensors_save",
    "optimizer_format",
]

logger = logging.getLogger(__name__)

PLAN_NAME = "elixir_plan.json"
MARKER_NAME = "elixir_checkpoint.json"
NOTE_NAME = "OPTIMIZER_README.md"
"""For a reader without Elixir (``checkpoint/note.py``): documentation, so not summed in the marker."""
_MARKER_FORMAT = "elixir-checkpoint/1"
_SHARD_RE = re.compile(r"^elixir_optim_rank\d+\.pt$")
OPTIM_INDEX = "optimizer.safetensors.index.json"
_OPTIM_RE = re.compile(r"^optimizer-(\d{5})-of-\d{5}\.safetensors$")
PLAIN_OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.bin")
"""A plain torch optimizer's ``state_dict()``: the stock Trainer's / Accelerate's ``save_state``'s."""
_BLOCK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or trusted; raised on every rank."""


class Digest(TypedDict):
    """A written file's size and CRC-32, as the marker records it."""

    bytes: int
    crc32: int


class Marker(TypedDict):
    """The marker ``seal`` writes last (``MARKER_NAME``): the step and every file's ``Digest``."""

    format: str
    step: int | None
    optimizer: bool
    world_size: int | None
    """The ranks that saved the optimizer state; ``None`` without one."""
    files: dict[str, Digest]


_T = TypeVar("_T")


class _Summing:
    """The file object ``write`` sees: sums what passes and keeps the first OS error, which
    ``torch.save``'s C++ writer would turn into ``basic_ios::clear: iostream error``. ``bar``
    counts the bytes."""

    def __init__(self, f: BinaryIO, bar: Bar) -> None:
        self.f, self.crc, self.bytes, self.bar = f, 0, 0, bar
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
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


def _replace(path: str | os.PathLike[str], produce: Callable[[Path], Digest]) -> Digest:
    """``produce(tmp)`` writes and fsyncs a temporary file next to ``path`` and returns its size and
    CRC-32; it is renamed into place and the folder fsynced. On any error the temporary file is
    removed and an ``OSError`` names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # this pid's leftover, or a planted link: removed, never written through
        digest = produce(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise OSError(
                e.errno or errno.EIO,
                f"{e.strerror or e} (writing checkpoint file {path}; the partial file was removed)",
                str(path),
            ) from e
        raise
    return digest


def _write_file(path: str | os.PathLike[str], write: Callable[[_Summing], object]) -> Digest:
    """``write(f)`` into ``path`` atomically and durably; returns its size and CRC-32."""

    def produce(tmp: Path) -> Digest:
        with _create(tmp) as f, progress(None, f"elixir: writing {Path(path).name}", unit="B") as bar:
            out = _Summing(f, bar)
            try:
                write(out)
            except BaseException as e:
                if out.error is not None:  # the OS error a C++ writer turned into its own
                    raise out.error from e
                raise
            f.flush()
            os.fsync(f.fileno())
        return {"bytes": out.bytes, "crc32": out.crc}

    return _replace(path, produce)


def _create(path: Path) -> BinaryIO:
    """A new file at ``path``: never one that exists ("x": ``O_EXCL``), nor through a symbolic link."""
    return open(path, "xb", opener=_no_follow)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def atomic_safetensors_save(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str]
) -> Digest:
    """``safetensors.torch.save_file`` atomically and durably. It writes from the tensors' memory
    (``save`` would build the whole file in memory first, twice), so the file is read back once for
    its CRC-32."""

    def produce(tmp: Path) -> Digest:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as e:  # its writer's OS errors (a full disk) come as this: name the file
            raise OSError(errno.EIO, str(e)) from e
        with progress(tmp.stat().st_size, f"elixir: summing {Path(path).name}", unit="B") as bar:
            return _sum_file(tmp, bar, fsync=True)

    return _replace(path, produce)


def atomic_torch_save(obj: object, path: str | os.PathLike[str]) -> Digest:
    return _write_file(path, lambda f: torch.save(obj, cast(BinaryIO, f)))  # a file object: write, flush


def atomic_write_text(text: str, path: str | os.PathLike[str]) -> Digest:
    return _write_file(path, lambda f: f.write(text.encode()))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sum_file(path: Path, bar: Bar, fsync: bool = False) -> Digest:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc, size = zlib.crc32(block, crc), size + len(block)
            bar.update(len(block))
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": size, "crc32": crc}


@contextlib.contextmanager
def staged_dir(output_dir: str | os.PathLike[str]) -> Iterator[str]:
    """Yields a fresh folder next to ``output_dir``; on success its files (fsynced) replace those
    in it and the folder is fsynced.

    Weight files of an earlier save that the new save does not write (another shard count) are
    removed, so ``from_pretrained`` never mixes two saves.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".elixir-save-{os.getpid()}-", dir=out))  # the pid: folder_lock.sweep
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
    _raise_any(_gather(error), what)


def _raise_any(errors: list[str | None], what: str) -> None:
    """``CheckpointError`` listing each rank's error, if any rank has one (``errors``: by rank)."""
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError(f"{what} failed:\n  " + "\n  ".join(bad))


def _error(fn: Callable[[], _T]) -> tuple[_T | None, str | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by all_ranks_agree
        return None, f"{type(e).__name__}: {e}"


def unmark(folder: str | os.PathLike[str]) -> None:
    """Before saving into ``folder`` again: it is torn until ``seal`` marks it (rank 0)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / MARKER_NAME).unlink()


def seal(
    folder: str | os.PathLike[str], digests: dict[str, Digest], *, step: int | None, optimizer: bool, is_main: bool
) -> None:
    """A collective, once every rank has written its files into ``folder``: the main process sums
    (and fsyncs) the files no rank summed while writing (``digests``: this rank's) and writes the
    marker last. Any rank's failure is raised on every rank."""
    everyone: dict[str, Digest] = {}
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
                if (
                    p.is_file()
                    and rel not in (MARKER_NAME, NOTE_NAME)
                    and not any(s.startswith(".") for s in rel.split("/"))
                ):
                    paths[rel] = p
            todo = sum(p.stat().st_size for rel, p in paths.items() if not everyone.get(rel))
            with progress(todo, "elixir: summing the checkpoint's files", unit="B") as bar:
                files = {rel: everyone.get(rel) or _sum_file(p, bar, fsync=True) for rel, p in paths.items()}
            marker: Marker = {
                "format": _MARKER_FORMAT,
                "step": step,
                "optimizer": optimizer,
                "world_size": len(ranks) if optimizer else None,
                "files": files,
            }
            atomic_write_text(json.dumps(marker, indent=1), folder / MARKER_NAME)

        _, error = _error(write)
    all_ranks_agree(error, f"sealing checkpoint {folder}")


def read_marker(folder: str | os.PathLike[str]) -> Marker | None:
    """``folder``'s marker; ``None`` without one; ``CheckpointError`` naming it when it is not a
    marker (empty, not JSON, a field missing: an interrupted copy leaves it so) or names a file
    outside ``folder``."""
    path = Path(folder) / MARKER_NAME
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is corrupt ({path.stat().st_size} bytes, not JSON: {e})") from None
    problem = _marker_problem(marker)
    if problem is not None:
        raise CheckpointError(f"{path} is corrupt: {problem}")
    for name in marker["files"]:
        confined(folder, name, path)
    return cast(Marker, marker)


def _marker_problem(marker: object) -> str | None:
    """What makes ``marker`` not one ``seal`` writes: ``None`` if nothing."""
    if not isinstance(marker, dict) or not marker:
        return f"it holds {json.dumps(marker)[:40]}, not the checkpoint's step and files"
    if marker.get("format") != _MARKER_FORMAT:
        return f"its format is {marker.get('format')!r}, not {_MARKER_FORMAT!r}"
    files = marker.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), int)
        for e in files.values()
    ):
        return "its 'files' is not a table of each file's bytes and crc32"
    if not (marker.get("step") is None or isinstance(marker.get("step"), int)):
        return f"its 'step' is {marker.get('step')!r}, not a step number"
    return None


def confined(folder: str | os.PathLike[str], name: str, source: str | os.PathLike[str]) -> Path:
    """``folder / name`` for a file name read from ``source`` (a marker, an index): a relative path
    inside ``folder``, or ``CheckpointError`` naming both."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name:
        raise CheckpointError(
            f"{source} names the file {name!r}, which is not inside the checkpoint folder {folder}: a checkpoint's "
            "files are read from its own folder only. Resume from another checkpoint"
        )
    return Path(folder, name)


def verify(folder: str | os.PathLike[str], rank: int, is_main: bool) -> Marker:
    """A collective before anything is loaded: ``folder`` has its marker and every file matches the
    size and CRC-32 recorded at save (optimizer file ``k`` is read by rank ``k`` modulo the ranks,
    the main process reads the rest).
    Returns the marker; raises ``CheckpointError`` on every rank naming each bad file."""
    folder = Path(folder)

    def check() -> Marker:
        marker = read_marker(folder)
        if marker is None:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: it has no {MARKER_NAME}, which a save writes last (the save was "
                "interrupted, or the folder was not written by Elixir). Resume from an earlier checkpoint; "
                "resume_from_checkpoint=True picks the newest complete one"
            )
        bad = []
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        mine = {name: want for name, want in marker["files"].items() if _verifier(name, world_size, rank, is_main)}
        with progress(sum(w["bytes"] for w in mine.values()), "elixir: verifying the checkpoint", unit="B") as bar:
            for name, want in mine.items():
                bad += _check_file(folder / name, want, bar)
        if bad:
            raise CheckpointError("; ".join(bad) + ". Resume from another checkpoint")
        return marker

    marker, error = _error(check)
    all_ranks_agree(error, f"verifying checkpoint {folder}")
    assert marker is not None  # else error, raised on every rank
    seen = _gather((str(folder), marker["step"]))  # node-local disks: each rank reads its node's folder
    if len({step for _, step in seen}) > 1:
        raise CheckpointError(
            "the ranks would resume from different steps: "
            + "; ".join(f"rank {r}: {f} (step {step})" for r, (f, step) in enumerate(seen))
            + ". Each node picked its own newest complete checkpoint (a save completed on some nodes only): "
            "pass resume_from_checkpoint=<output_dir>/checkpoint-N with a step every node has"
        )
    return marker


def _verifier(name: str, world_size: int, rank: int, is_main: bool) -> bool:
    """Whether this rank checks file ``name``: optimizer file ``k`` is rank ``k``'s (modulo this
    run's ranks, which may be fewer than the saving run's), everything else the main process's."""
    m = _SHARD_RE.match(name) or _OPTIM_RE.match(name)
    return int(m.group(1)) % world_size == rank if m else is_main


def _check_file(path: Path, want: Digest, bar: Bar) -> list[str]:
    """What is wrong with ``path`` against its marker entry ``want``: nothing, or one message."""
    if not path.is_file():
        return [f"{path} is missing"]
    got = _sum_file(path, bar)
    if got["bytes"] != want["bytes"]:
        return [f"{path} is truncated or overwritten: {got['bytes']} bytes, {want['bytes']} at save"]
    if got["crc32"] != want["crc32"]:
        return [f"{path} is corrupt or from another checkpoint: its CRC-32 differs from the one saved"]
    return []


def checkpoint_folders(output_dir: str | os.PathLike[str]) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir`` (the Trainer's names), newest first."""
    folders = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name[11:].isdigit()]
    return sorted(folders, key=lambda p: int(p.name[11:]), reverse=True)


def newest_complete(output_dir: str | os.PathLike[str], required: bool = True) -> str | None:
    """``resume_from_checkpoint=True``: the newest ``checkpoint-N`` with a well-formed marker; warns
    about each newer one it passes over: torn (no marker: a save interrupted by a crash) or with its
    marker corrupt (an interrupted copy), naming why. None complete: an error, or ``None`` (and the
    warning) when not ``required``."""
    torn, corrupt = [], []
    for p in checkpoint_folders(output_dir):
        try:
            if read_marker(p) is not None:
                break
            torn.append(str(p))
        except (CheckpointError, OSError) as e:
            corrupt.append(f"{p} ({e})")
    else:
        p = None
    skipped = [f"torn checkpoint(s) {', '.join(torn)} (no {MARKER_NAME}: a save was interrupted)"] if torn else []
    skipped += [f"checkpoint(s) with a corrupt marker: {'; '.join(corrupt)}"] if corrupt else []
    if skipped and (p is not None or not required):
        logger.warning(
            "skipping %s; %s",
            "; and ".join(skipped),
            f"resuming from {p}" if p is not None else "no complete checkpoint is left to resume from",
        )
    if p is None and required:
        raise CheckpointError(
            f"No valid checkpoint found in output directory ({output_dir}): no complete checkpoint to resume from"
            + (f" (skipped {'; and '.join(skipped)})" if skipped else "")
            + ": start without resume_from_checkpoint, or pass a checkpoint folder"
        )
    return str(p) if p is not None else None


def optimizer_format(checkpoint: str | os.PathLike[str]) -> str | None:
    """How ``checkpoint`` holds the optimizer state: ``"named"`` (by parameter name, any layout),
    ``"plain"`` (a torch optimizer's ``state_dict()`` in a folder without Elixir files: the stock
    Trainer's or Accelerate's), ``None``. The per-rank chunk shards that versions before 0.1.0 wrote
    are refused (``CheckpointError`` naming the version that reads them): every reader asks here first."""
    ckpt = Path(checkpoint)
    if (ckpt / OPTIM_INDEX).is_file():
        return "named"
    if not ckpt.is_dir():
        return None
    if any(_SHARD_RE.match(p.name) for p in ckpt.iterdir()):
        raise CheckpointError(
            f"{ckpt} holds the optimizer state as per-rank chunk shards (elixir_optim_rank{{r}}.pt), which "
            "elixir-hf wrote before 0.1.0 and no longer reads. Resume it once with elixir-hf 0.1.0 (pip install "
            f"elixir-hf==0.1.0), the last version that reads them, on as many processes as saved it and with "
            f"--elixir {ckpt / PLAN_NAME}, save a checkpoint (by parameter name), and resume from that one"
        )
    elixir = (ckpt / MARKER_NAME).is_file() or (ckpt / PLAN_NAME).is_file()
    if not elixir and any((ckpt / n).is_file() for n in PLAIN_OPTIMIZER_NAMES):
        return "plain"
    return None


def check_resume(
    checkpoint: str | os.PathLike[str], model: nn.Module, world_size: int, rank: int, is_main: bool
) -> Marker | None:
    """Fails before any weight is loaded, on every rank, when the checkpoint cannot continue this
    run (a bad file, another model, an optimizer format no longer read); returns its marker
    (``None``: a plain PyTorch checkpoint, which has none)."""
    ckpt = Path(checkpoint)
    fmt = optimizer_format(ckpt)
    if fmt == "plain":
        logger.info(
            "resuming from %s, a plain PyTorch checkpoint: Adam moments mapped to names by optimizer order", ckpt
        )
        _check_weights_match(ckpt, model)
        return None
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
        for f in files:
            confined(ckpt, f, index)
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
