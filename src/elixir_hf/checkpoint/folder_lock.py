"""One job per output folder: an advisory lock that ``ElixirTrainer`` holds on ``output_dir`` from
its ``train()`` to the end of the job.

Two jobs writing one ``output_dir`` both exit 0 while the later one's checkpoints silently replace
the other's, and a resume can read a checkpoint the other is still writing. The saving process
takes an exclusive ``flock`` on ``output_dir/.elixir-job.lock`` when ``train()`` starts and writes
who it is into it (host, pid, job id, start time); a second job finds the lock held and stops
before training, naming the folder and the job holding it. The lock is held until the job's last
write ([Note: held to the last write]). The kernel drops a ``flock`` when its process dies, so a
lock left by a crashed job is not held: the next job takes it over, saying whose it was (a job that
ends cleanly removes the file while it holds it; a job that locked the file just before is told by
the file's inode and locks the path's new one), and, holding it, sweeps what that job's interrupted
saves left ([Note: what a kill leaves]). ``flock`` is local to a host's kernel: two hosts sharing a
network folder are not told apart on every file system.

The lock file is opened with ``O_NOFOLLOW``: in a folder others can write, a symbolic link planted
at its name would make the job truncate and write the link's target; it is refused, naming it.

[Note: held to the last write]
A script's ``trainer.train()`` is followed by ``trainer.save_model()``, whose stage a second job
started in between would take for an interrupted save's and remove. So the lock is held for as
long as the ``ElixirTrainer`` that took it lives (``hold(folder, owner)``: released when the owner is
garbage-collected, else at the process's exit), not for the ``train()`` call. It is re-entrant in a
process: a second trainer on the same folder in one process (a resume in a notebook) shares the
hold, which ends with the last of them.

[Note: what a kill leaves]
A save writes each file to a temporary name beside it (``.NAME.tmp<pid>``, ``format._replace``) and
``save_model`` into a stage folder (``.elixir-save-<pid>-*``, ``format.staged_dir``); a kill
meanwhile leaves them, full-size (a rank's Adam shard is 12 bytes per parameter of its share). The
next job, once it holds the lock, removes those in the folder and its checkpoints whose writer, the
pid in the name, is not running on this host (a stage named without a pid, as before 0.2, always).
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOCK_NAME", "FolderInUse", "FolderLockError", "hold", "sweep"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".elixir-job.lock"

_JOB_ID_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID")
_STAGE_RE = re.compile(r"^\.elixir-save-(?:(\d+)-)?")
_TMP_RE = re.compile(r"^\..+\.tmp(\d+)$")


class FolderLockError(RuntimeError):
    """The output folder's lock cannot be taken."""


class FolderInUse(FolderLockError):
    """Another live job holds the output folder's lock."""


@dataclass
class _Hold:
    """This process's lock on one folder: the open file holding the ``flock``, and how many owners share it."""

    path: Path
    fd: int
    owners: int = 0


_HOLDS: dict[Path, _Hold] = {}
_OWNED: weakref.WeakKeyDictionary[object, set[Path]] = weakref.WeakKeyDictionary()


def hold(folder: str | os.PathLike[str], owner: object) -> None:
    """Holds ``folder``'s lock for as long as ``owner`` lives ([Note: held to the last write]);
    ``FolderInUse`` if another live job holds it, ``FolderLockError`` (or the ``OSError``) naming the
    file if it cannot be taken."""
    key = Path(folder).resolve()
    held = _OWNED.setdefault(owner, set())
    if key in held:
        return
    if key not in _HOLDS:
        _HOLDS[key] = _take(Path(folder))
    _HOLDS[key].owners += 1
    held.add(key)
    weakref.finalize(owner, _drop, key)


def _drop(key: Path) -> None:
    h = _HOLDS[key]
    h.owners -= 1
    if h.owners == 0:
        del _HOLDS[key]
        try:
            h.path.unlink()  # a clean end leaves nothing behind, and nothing for the next job to take over
        except OSError:
            pass
        os.close(h.fd)  # releases the flock


def _take(folder: Path) -> _Hold:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): nothing to hold
        return _Hold(folder / LOCK_NAME, os.open(os.devnull, os.O_RDONLY))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    while True:  # the lock of the file at the path now: a job ending unlinks it (see above)
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or {}
            os.close(fd)
            raise FolderInUse(
                f"{folder} is in use by another job ({_describe(holder)}): two jobs in one output_dir overwrite each "
                "other's checkpoints. Give this run its own --output_dir, or wait for that job to end"
            ) from None
        if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # locked a file that its holder unlinked as it ended: open the path's again
    previous = _read(fd)
    if previous is not None:  # written by a job that did not end cleanly, and is gone: the lock was free
        logger.warning(
            "elixir: %s was locked by a job that is not running (%s): taking it over", folder, _describe(previous)
        )
    sweep(folder)
    _write(fd, _me())
    return _Hold(path, fd)


def _open(path: Path) -> int:
    """The lock file, never through a symbolic link, and only a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise FolderLockError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); the job lock is never taken through one, as the "
            f"job writes into it. Remove {path} (or run in a folder others cannot write) and start again"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FolderLockError(f"{path} is not a regular file: remove it and start again")
    return fd


def sweep(folder: str | os.PathLike[str]) -> list[Path]:
    """Removes what interrupted saves left in ``folder`` and its checkpoints: save stages and temporary
    files whose writer is not running ([Note: what a kill leaves]); returns them. Call it holding the lock."""
    folder = Path(folder)
    gone = []
    for p in sorted(p for pattern in (".*", "*/.*") for p in folder.glob(pattern)):
        stage, tmp = _STAGE_RE.match(p.name), _TMP_RE.match(p.name)
        writer = stage.group(1) if stage else tmp.group(1) if tmp else None
        real_dir = p.is_dir() and not p.is_symlink()
        if not (stage and real_dir or tmp and not real_dir) or (writer is not None and _running(int(writer))):
            continue
        logger.warning("elixir: removing %s, left by an interrupted save", p)
        if real_dir:
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _me() -> dict[str, object]:
    job = next((f"{v}={os.environ[v]}" for v in _JOB_ID_VARS if os.environ.get(v)), None)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "started": started}


def _describe(holder: dict[str, object]) -> str:
    job = f", {holder['job']}" if holder.get("job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def _read(fd: int) -> dict[str, object] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        holder = json.loads(text) if text else None
    except json.JSONDecodeError:
        holder = None
    if text and not isinstance(holder, dict):
        return {"pid": "?", "host": "?", "started": f"unreadable lock ({len(text)} characters)"}
    return holder


def _write(fd: int, holder: dict[str, object]) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())
    os.fsync(fd)
