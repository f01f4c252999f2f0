"""Multi-process harness for tests of distributed code: gloo ranks on the CPU, NCCL ranks on GPUs
(``ELIXIR_TEST_DEVICE=cuda``, ``helpers.device``).

``run_distributed`` starts one process per rank, wires them into a gloo
process group through a FileStore (no TCP port races between parallel test
runs), and turns any rank's exception, crash or hang into a parent-side
failure instead of a deadlocked test session.

The ranks are forked from a forkserver that has imported torch and transformers
once per test session (``PRELOAD``): a spawned rank spent 10-25 s of a loaded
2-core CI machine importing them, the larger part of most multi-rank tests.
Each rank still starts from a fresh process's state (nothing of the test
process is inherited) and with the test process's environment at start().
On GPUs the ranks are spawned instead (a forkserver that imported the suite has
initialised CUDA, which a forked process cannot use), each on its own GPU.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .device import ON_CUDA, rank_device
from .lifetime import die_with_parent

if __name__ != "helpers.dist" and __name__.endswith("helpers.dist"):
    # A second copy of this module (``tests.helpers.dist``) has its own PRELOAD, without what
    # tests/conftest.py adds: if it starts the forkserver first, every rank of the session imports
    # transformers itself (4-5 s more per launch on 2 cores).
    raise ImportError(f"import helpers.dist, not {__name__}: the forkserver must preload what tests/conftest.py adds")

# After the first failure, how long to wait for other ranks' reports before
# killing them (ranks blocked in a collective with the dead rank never report).
_ERROR_GRACE_S = 2.0
_POLL_S = 0.1
PRELOAD = ["torch", "torch.distributed"]
"""Imported once by the forkserver, before it forks any rank (one that fails to import is skipped);
tests/conftest.py adds the suite's heavy imports (transformers, the tiny models' modeling files)."""


class DistributedError(RuntimeError):
    """One or more ranks raised, crashed, or the group timed out."""


@contextmanager
def _env(**overrides: str) -> Iterator[None]:
    """Temporarily set env vars so spawned children inherit them at start()."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    results: Any,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    """Child entry: join the group, run ``fn``, report a pickled result or traceback."""
    die_with_parent()  # the forkserver, which exits with the test process: no rank outlives an interrupted run
    os.environ.clear()  # the test process's environment now, not the forkserver's at its start
    os.environ.update(environ, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        if ON_CUDA:
            torch.cuda.set_device(rank_device(rank))  # the rank's local_device()
        dist.init_process_group(
            backend="nccl" if ON_CUDA else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            device_id=rank_device(rank) if ON_CUDA else None,
        )
        # Every rank's connections are up before any rank can run ``fn`` and leave: a rank that
        # finished (or died) early closed its sockets under a peer still in connectFullMesh.
        dist.barrier()
        # Pickled here: a Queue pickles in a feeder thread, where errors vanish.
        value = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        # Reported before the group is torn down: NCCL's teardown flushes this rank's collectives,
        # which peers that went on without it may never join (the parent ends the ranks then).
        results.put((rank, False, traceback.format_exc()))
        with suppress(Exception):
            _leave()
        return
    try:
        _leave()
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, value))


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo; NCCL on GPUs).

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level).
    Returns the per-rank return values ordered by rank.  Raises
    :class:`DistributedError` carrying every reported traceback if any rank
    fails, exits without reporting, or the whole run exceeds ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if ON_CUDA and world_size > torch.cuda.device_count():
        pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn" if ON_CUDA else "forkserver")
    if not ON_CUDA:
        ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="elixir_dist_")
    store_path = os.path.join(tmpdir, "store")
    procs = []
    try:
        with _env(OMP_NUM_THREADS="1"):  # the forkserver's own environment, if this starts it
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, store_path, timeout, results, args, dict(os.environ)),
                    daemon=True,
                )
                p.start()
                procs.append(p)

        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if grace_deadline is not None and now >= grace_deadline:
                break
            if now >= deadline:
                missing = sorted(set(range(world_size)) - values.keys() - errors.keys())
                errors.setdefault(-1, f"timed out after {timeout}s; ranks {missing} did not finish")
                break
            try:
                rank, ok, payload = results.get(timeout=_POLL_S)
            except queue_mod.Empty:
                # A rank that died without reporting (segfault, os._exit) never will.
                for r, p in enumerate(procs):
                    if r not in values and r not in errors and p.exitcode is not None and results.empty():
                        errors[r] = f"exited with code {p.exitcode} without reporting"
                if errors and grace_deadline is None:
                    grace_deadline = time.monotonic() + _ERROR_GRACE_S
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + _ERROR_GRACE_S

        if errors:
            _kill(procs)
            report = "\n".join(
                f"--- rank {r} ---\n{msg}" if r >= 0 else f"--- harness ---\n{msg}" for r, msg in sorted(errors.items())
            )
            raise DistributedError(f"{len(errors)} failure(s) in run_distributed(world_size={world_size}):\n{report}")
        for p in procs:
            p.join(timeout=30)
        return [values[r] for r in range(world_size)]
    finally:
        _kill(procs)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
