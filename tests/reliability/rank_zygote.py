"""Started once per test process by ``launch.run_ranks`` on the CPU: imports what the workers import
(torch, transformers, Accelerate, elixir_hf's Trainer; 7 s of CPU per process on the 2-core test host)
once, then serves the calls it reads on stdin until that closes (the test process has ended). Each call
is a JSON line ``{"logs", "ranks", "script", "args", "env", "new_group"}`` (``ranks``: each rank's own
variables, ``RANK``, ``LOCAL_RANK``, ...): a child forked for it takes
the call's environment (and, with ``new_group``, a process group of its own) and forks each rank, which
runs the worker script as ``__main__`` and ends as a process of its own would (its atexit handlers, its
exit status). Each of these processes dies with the one that started it (``helpers.lifetime``).

Written to ``LOGS``, each file whole and then renamed into place (the launcher reads it as soon as it
exists): ``pids``, the call's child then each rank; each rank's stderr to ``rank<r>.err`` and its exit
status and end time (``time.time()``) to ``rank<r>.end`` as it ends; ``failed``, the traceback of a
call that failed before its ranks were forked.

``rank_zygote.py``."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import hf_cases  # noqa: E402, F401 - torch, transformers and elixir_hf's Trainer
import torch.distributed  # noqa: E402, F401

import elixir_hf.accelerator  # noqa: E402, F401
import elixir_hf.trainer  # noqa: E402, F401
from helpers.lifetime import die_with_parent  # noqa: E402

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Ignored by a call's child (a signal to the ranks' process group is theirs), each rank's own again in the rank."""


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def rank(r: int, own: dict[str, str], logs: str, script: str, args: list[str]) -> None:
    """In the forked child: rank ``r``'s environment (``own`` over the call's) and stderr, then the script
    as ``__main__``."""
    die_with_parent()  # the call's child, which outlives its ranks unless the run is interrupted
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    os.environ.update(own)
    err = os.open(os.path.join(logs, f"rank{r}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # the interpreter's own end: atexit handlers, as a process started for the script runs them


def call(logs: str, ranks: list[dict[str, str]], script: str, args: list[str]) -> None:
    """In a call's child: fork the ranks, then write each one's end as it ends."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    pids = {}
    for r, own in enumerate(ranks):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rank(r, own, logs, script, args)  # never returns
        pids[pid] = r
    _write(os.path.join(logs, "pids"), "\n".join(str(p) for p in [os.getpid(), *pids]))
    while pids:
        pid, status = os.waitpid(-1, 0)
        ended = time.time()
        _write(os.path.join(logs, f"rank{pids.pop(pid)}.end"), f"{os.waitstatus_to_exitcode(status)} {ended}")


def serve() -> None:
    die_with_parent()  # the test process, as its stdin's end would tell
    for line in sys.stdin:
        request = json.loads(line)
        while True:  # reap the children of calls that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if os.fork() == 0:
            logs, child = request["logs"], os.getpid()
            try:
                die_with_parent()
                os.dup2(os.open(os.devnull, os.O_RDWR), 0)
                os.dup2(0, 1)
                os.environ.clear()
                os.environ.update(request["env"])
                if request["new_group"]:
                    os.setpgid(0, 0)
                call(logs, request["ranks"], request["script"], request["args"])
            except BaseException:
                if os.getpid() != child:  # a rank's own end (``sys.exit``, its error): the interpreter's
                    raise
                _write(os.path.join(logs, "failed"), traceback.format_exc())
                os._exit(1)
            os._exit(0)


if __name__ == "__main__":
    serve()
