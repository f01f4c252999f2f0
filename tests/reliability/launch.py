"""Runs a worker script of this folder in fresh processes, as a user would: under ``torchrun``
(``run_script``), or as ranks of its environment started here, each on its own (``run_ranks``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
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


def assert_clean_exits(runs: list[subprocess.CompletedProcess] | list[RankEnd]) -> None:
    """Every run (or rank) ended with exit code 0 and without gloo's ``terminate called`` abort."""
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
    """``time.time()`` when it ended (as the forking process's wait returned; for a rank started as a
    process of its own, as the launcher saw it, polled every 50 ms)."""


def run_ranks(
    script: str,
    *args: str,
    ranks: int = 2,
    nodes: int = 1,
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
    in one process group of their own, as a SLURM step's tasks are for ``scancel``. On the CPU the ranks
    are forked by ``rank_zygote.py``, which imports torch, transformers and elixir_hf once per test
    process (7 s of CPU on the 2-core test host); on GPUs each is a process of its own."""
    host = "127.0.0.1"
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if store == "launcher" else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ELIXIR_CONFIG", None)
    per_node, rest = divmod(ranks, nodes)
    assert per_node and not rest, f"{ranks} ranks do not make {nodes} nodes of as many ranks each"
    env.update(
        WORLD_SIZE=str(ranks),
        ROLE_WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_WORLD_SIZE=str(nodes),
        MASTER_ADDR=host,
        MASTER_PORT=str(server.port if server is not None else _free_port(host)),
        TORCHELASTIC_USE_AGENT_STORE=str(server is not None),
        ELIXIR_TEST_DEVICE="cuda" if cuda else "cpu",
    )
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    path = str(Path(__file__).with_name(script))
    each = [_rank_env(r, per_node) for r in range(ranks)]
    with tempfile.TemporaryDirectory(prefix="elixir_ranks_") as logs:
        child, ranks_ = None, list[_Rank]()
        if cuda:  # a process each: a fork after torch's import is no place to start CUDA in
            for r, own in enumerate(each):
                group = (ranks_[0].pid if ranks_ else 0) if new_group else None
                ranks_.append(_Popened(path, args, {**env, **own}, r, logs, group))
        else:
            child, ranks_ = _forked(path, args, env, each, logs, new_group)
        try:
            out = _wait(ranks_, script, timeout)
        finally:  # nothing of the call outlives it, whatever ended it
            for r in ranks_:
                if not r.ended():
                    r.kill()
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
    del server
    return out


def _rank_env(r: int, per_node: int) -> dict[str, str]:
    """What ``torchrun`` sets apart for global rank ``r`` of nodes of ``per_node`` ranks."""
    return dict(RANK=str(r), ROLE_RANK=str(r), LOCAL_RANK=str(r % per_node), GROUP_RANK=str(r // per_node))


class _Rank:
    """One rank run by ``run_ranks``: its pid, and how it ended once it has (``None`` before)."""

    pid: int

    def ended(self) -> tuple[int, float] | None:
        raise NotImplementedError

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stderr(self) -> str:
        raise NotImplementedError


class _Popened(_Rank):
    """A rank started as a process of its own (``python script``)."""

    def __init__(self, path: str, args: tuple[str, ...], env: dict, r: int, logs: str, group: int | None) -> None:
        self.err = os.path.join(logs, f"rank{r}.err")
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, path, *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                process_group=group,
            )
        self.pid, self._end = self.proc.pid, None

    def ended(self) -> tuple[int, float] | None:
        if self._end is None and self.proc.poll() is not None:
            self._end = (self.proc.returncode, time.time())
        return self._end

    def stderr(self) -> str:
        return Path(self.err).read_text()


class _Forked(_Rank):
    """A rank forked by ``rank_zygote.py`` after the imports."""

    def __init__(self, pid: int, r: int, logs: str) -> None:
        self.pid, self.end, self.err = pid, os.path.join(logs, f"rank{r}.end"), os.path.join(logs, f"rank{r}.err")

    def ended(self) -> tuple[int, float] | None:
        if not os.path.exists(self.end):
            return None
        status, at = Path(self.end).read_text().split()
        return int(status), float(at)

    def stderr(self) -> str:
        return Path(self.err).read_text() if os.path.exists(self.err) else ""


_ZYGOTE: subprocess.Popen | None = None
"""``rank_zygote.py`` serving this process's ``run_ranks`` calls on the CPU, started with the first call's
environment (each call's child takes its own); it ends as this process does (its stdin closes)."""


def _zygote(env: dict) -> subprocess.Popen:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.poll() is not None:
        _ZYGOTE = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("rank_zygote.py"))],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=tempfile.TemporaryFile("w+"),
            text=True,
        )
    return _ZYGOTE


def _forked(
    path: str, args: tuple[str, ...], env: dict, each: list[dict[str, str]], logs: str, new_group: bool
) -> tuple[int, list[_Rank]]:
    """The ranks forked by ``rank_zygote.py``, which has imported what they import (seconds a rank) once;
    the first is the call's own child there, which writes the ranks' ends."""
    zygote = _zygote(env)
    call = dict(logs=logs, ranks=each, script=path, args=args, env=env, new_group=new_group)
    zygote.stdin.write(json.dumps(call) + "\n")  # type: ignore[union-attr]
    zygote.stdin.flush()  # type: ignore[union-attr]
    pids, failed = os.path.join(logs, "pids"), os.path.join(logs, "failed")
    while not os.path.exists(pids):
        if os.path.exists(failed):
            raise RuntimeError(f"rank_zygote.py could not fork the ranks:\n{Path(failed).read_text()[-3000:]}")
        if zygote.poll() is not None:
            zygote.stderr.seek(0)  # type: ignore[union-attr]
            raise RuntimeError(f"rank_zygote.py ended:\n{zygote.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        time.sleep(0.05)
    child, *forked = Path(pids).read_text().split()
    return int(child), [_Forked(int(pid), r, logs) for r, pid in enumerate(forked)]


def _wait(ranks: list[_Rank], script: str, timeout: float) -> list[RankEnd]:
    """Each rank's end; a rank left stopped once every other one has ended is killed."""
    deadline = time.monotonic() + timeout
    while not all(r.ended() for r in ranks):
        running = [r for r in ranks if not r.ended()]
        if all(_stopped(r.pid) for r in running):
            for r in running:
                r.kill()
        if time.monotonic() > deadline:
            for r in running:
                r.kill()
            raise TimeoutError(f"{script}: ranks {[ranks.index(r) for r in running]} still ran after {timeout} s")
        time.sleep(0.05)
    ends = [r.ended() for r in ranks]
    return [RankEnd(code, r.stderr(), at) for r, (code, at) in zip(ranks, ends)]  # type: ignore[misc]


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
