"""Started by ``launch.run_ranks`` on the CPU: imports what the workers import (torch, transformers,
Accelerate, elixir_hf's Trainer; 7 s of CPU per process on the 2-core test host) once, then forks each
rank, which runs the worker script as ``__main__`` and ends as a process of its own would (its atexit
handlers, its exit status). The ranks' pids go to ``LOGS/pids``; each rank's stderr to
``LOGS/rank<r>.err``, its exit status and end time (``time.time()``) to ``LOGS/rank<r>.end`` as it ends (each file
written whole, then renamed into place: the launcher reads it as soon as it exists).

``rank_zygote.py LOGS RANKS SCRIPT ARGS...``."""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import hf_cases  # noqa: E402, F401 - torch, transformers and elixir_hf's Trainer
import torch.distributed  # noqa: E402, F401

import elixir_hf.accelerator  # noqa: E402, F401
import elixir_hf.trainer  # noqa: E402, F401

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Ignored here (a signal to the ranks' process group is theirs), each rank's own again in the rank."""


def rank(r: int, logs: str, script: str, args: list[str]) -> None:
    """In the forked child: rank ``r``'s environment and stderr, then the script as ``__main__``."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r))
    err = os.open(os.path.join(logs, f"rank{r}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # the interpreter's own end: atexit handlers, as a process started for the script runs them


def main(logs: str, ranks: int, script: str, args: list[str]) -> None:
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    pids = {}
    for r in range(ranks):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rank(r, logs, script, args)  # never returns
        pids[pid] = r
    with open(os.path.join(logs, "pids.tmp"), "w") as f:
        f.write("\n".join(str(p) for p in pids))
    os.replace(os.path.join(logs, "pids.tmp"), os.path.join(logs, "pids"))
    while pids:
        pid, status = os.waitpid(-1, 0)
        ended = time.time()
        end = os.path.join(logs, f"rank{pids.pop(pid)}.end")
        with open(end + ".tmp", "w") as f:
            f.write(f"{os.waitstatus_to_exitcode(status)} {ended}")
        os.replace(end + ".tmp", end)  # whole or absent: the launcher polls for it


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
