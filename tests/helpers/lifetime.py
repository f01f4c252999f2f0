"""Processes the suite starts die with the process that started them: an interrupted ``make test``
(its pytest killed, a worker killed) leaves no rank, torchrun or xdist worker running on.

``die_with_parent()`` asks Linux to send this process ``SIGKILL`` when its parent exits
(``prctl(PR_SET_PDEATHSIG)``), and exits at once where the parent is already gone (the window
between the fork and the call). Called by each xdist worker (tests/conftest.py), each rank
``helpers.dist`` forks (whose parent is the forkserver, which exits with the test process), and, as a
``preexec_fn``, by the launchers the tests start (torchrun). Elsewhere than Linux, nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "parent_death_signal"]

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def _prctl(option: int, arg: int | ctypes.c_int | ctypes._Pointer) -> None:  # type: ignore[type-arg]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when its parent exits (Linux); at once if it has already."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # reparented before the call: the parent is gone
        os.kill(os.getpid(), sig)


def parent_death_signal() -> int:
    """The signal this process gets when its parent exits (0: none; always 0 elsewhere than Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    value = ctypes.c_int(0)
    _prctl(PR_GET_PDEATHSIG, ctypes.pointer(value))
    return value.value
