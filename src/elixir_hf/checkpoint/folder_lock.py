"""One job per output folder: an advisory lock that ``ElixirTrainer.train`` holds on ``output_dir``.

Two jobs writing one ``output_dir`` both exit 0 while the later one's checkpoints silently replace
the other's, and a resume can read a checkpoint the other is still writing. The saving process
takes an exclusive ``flock`` on ``output_dir/.elixir-job.lock`` for the whole of ``train()`` and
writes who it is into it (host, pid, job id, start time); a second job finds the lock held and
stops before training, naming the folder and the job holding it. The kernel drops a ``flock`` when
its process dies, so a lock left by a crashed job is not held: the next job takes it over, saying
whose it was (a job that ends cleanly removes the file while it holds it; a job that locked the
file just before is told by the file's inode and locks the path's new one), and, holding it, removes that job's orphaned save stages (``.elixir-save-*``, which a
kill during a save leaves full-size), which no live job can be writing. ``flock`` is local to a
host's kernel: two hosts sharing a network folder are not told apart on every file system.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "FolderInUse", "job_lock"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".elixir-job.lock"

_JOB_ID_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID")


class FolderInUse(RuntimeError):
    """Another live job holds the output folder's lock."""


def _me() -> dict[str, Any]:
    job = next((f"{v}={os.environ[v]}" for v in _JOB_ID_VARS if os.environ.get(v)), None)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "started": started}


def _describe(holder: dict[str, Any]) -> str:
    job = f", {holder['job']}" if holder.get("job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return {"pid": "?", "host": "?", "started": f"unreadable lock {text[:80]!r}"}


def _write(fd: int, holder: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())
    os.fsync(fd)


def _orphaned_stages(folder: Path) -> list[Path]:
    """Save stages (``format.staged_dir``) in ``folder`` and its checkpoints."""
    return sorted(p for pattern in (".elixir-save-*", "*/.elixir-save-*") for p in folder.glob(pattern) if p.is_dir())


@contextlib.contextmanager
def job_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Holds ``folder``'s lock inside; ``FolderInUse`` if another live job holds it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): nothing to hold
        yield
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    while True:  # the lock of the file at the path now: a job ending unlinks it (see below)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
    try:
        previous = _read(fd)
        if previous is not None:  # written by a job that did not end cleanly, and is gone: the lock was free
            logger.warning(
                "elixir: %s was locked by a job that is not running (%s): taking it over", folder, _describe(previous)
            )
        for stage in _orphaned_stages(folder):
            logger.warning("elixir: removing %s, the save stage of an interrupted save", stage)
            shutil.rmtree(stage, ignore_errors=True)
        _write(fd, _me())
        yield
        path.unlink()  # a clean end leaves nothing behind, and nothing for the next job to take over
    finally:
        os.close(fd)  # releases the flock
