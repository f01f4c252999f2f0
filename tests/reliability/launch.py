"""Runs a worker script of this folder in fresh processes, as a user would: under ``torchrun``
(``run_script``), or as ranks of its environment started here, each on its own (``run_ranks``)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

LONG = os.environ.get("ELIXIR_LONG_TESTS") == "1"
"""The long fault-injection loops (run once before merging); CI runs short ones."""


def run_script(
    script: str, *args: str, ranks: int | None = None, timeout: float = 300, new_group: bool = False
) -> subprocess.CompletedProcess:
    """``python script args`` next to this file, on the CPU; under ``torchrun`` with ``ranks``."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks else []
    return run_python(*launch, str(Path(__file__).with_name(script)), *args, timeout=timeout, new_group=new_group)


def run_python(*args: str, timeout: float = 300, new_group: bool = False) -> subprocess.CompletedProcess:
    """``python args`` on the CPU, with this process's import path and without ``ELIXIR_CONFIG``; in a
    process group of its own with ``new_group`` (a signal to its group reaches it and its children only)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ELIXIR_CONFIG", None)
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        process_group=0 if new_group else None,
    )


def assert_clean_exits(runs: list[subprocess.CompletedProcess]) -> None:
    """Every run ended with exit code 0 and without gloo's ``terminate called`` abort."""
    bad = [(i, r) for i, r in enumerate(runs) if r.returncode != 0 or "terminate called" in r.stderr]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit cleanly; first:\n{bad[0][1].stderr[-3000:]}"


# --------------------------------------------------------------------------- ranks started here


def on_cuda() -> bool:
    """In a worker: whether ``run_ranks`` gave this rank a GPU (``ELIXIR_TEST_DEVICE=cuda``)."""
    return os.environ.get("ELIXIR_TEST_DEVICE") == "cuda"


def backend_args() -> dict:
    """In a worker: the Trainer's arguments for this rank's device, gloo on the CPU or NCCL on its GPU."""
    return dict(use_cpu=False, ddp_backend="nccl") if on_cuda() else dict(ddp_backend="gloo")


@dataclasses.dataclass
class RankEnd:
    """How one rank of ``run_ranks`` ended."""

    returncode: int
    """Its exit status; ``-signal.SIGKILL`` for a rank left stopped and killed by the launcher."""
    stderr: str
    ended: float
    """``time.time()`` when the launcher saw it end (polled every 50 ms)."""


def run_ranks(
    script: str,
    *args: str,
    ranks: int = 2,
    cuda: bool = False,
    store: str = "launcher",
    timeout: float = 300,
    new_group: bool = False,
) -> list[RankEnd]:
    """``python script args`` next to this file as ``ranks`` processes with ``torchrun``'s environment
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...), on the CPU (gloo)
    or on a GPU each (``cuda``: NCCL, ``ELIXIR_TEST_DEVICE=cuda``), without ``torchrun``'s teardown: each
    rank ends on its own, so its exit status, stderr and end time are its own. ``store="launcher"``: the
    job's store is hosted here, as ``torchrun``'s launcher hosts it; ``"rank0"``: rank 0 hosts it
    (``init_method="env://"`` without ``torchrun``). A rank left stopped (SIGSTOP) once every other rank
    has ended is killed, as ``torchrun`` kills it after its shutdown timeout. ``new_group``: the ranks
    in one process group of their own (rank 0's), as a SLURM step's tasks are for ``scancel``."""
    host = "127.0.0.1"
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if store == "launcher" else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ELIXIR_CONFIG", None)
    env.update(
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        GROUP_RANK="0",
        MASTER_ADDR=host,
        MASTER_PORT=str(server.port if server is not None else _free_port(host)),
        TORCHELASTIC_USE_AGENT_STORE=str(server is not None),
        ELIXIR_TEST_DEVICE="cuda" if cuda else "cpu",
    )
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="elixir_ranks_") as logs:
        procs, files = [], []
        for r in range(ranks):
            files.append(open(os.path.join(logs, f"rank{r}.err"), "w+"))  # noqa: SIM115 - closed below
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name(script)), *args],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=subprocess.DEVNULL,
                    stderr=files[-1],
                    process_group=(procs[0].pid if procs else 0) if new_group else None,
                )
            )
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < ranks:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            running = [p for r, p in enumerate(procs) if r not in ended]
            if running and all(_stopped(p.pid) for p in running):
                for p in running:
                    p.kill()
            if time.monotonic() > deadline:
                for p in running:
                    p.kill()
                raise TimeoutError(
                    f"{script}: ranks {sorted(set(range(ranks)) - set(ended))} still ran after {timeout} s"
                )
            time.sleep(0.05)
        out = []
        for r, (p, f) in enumerate(zip(procs, files)):
            f.seek(0)
            out.append(RankEnd(p.returncode, f.read(), ended[r]))
            f.close()
    del server
    return out


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): its state in ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
