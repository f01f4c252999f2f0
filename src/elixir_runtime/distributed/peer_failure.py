"""A rank that gives up tells the others why: its reason is posted in the job's store, and a
collective that then fails on another rank raises it, not the transport error.

[Note: the rank that ran ahead]
When ranks diverge (``distributed/lockstep.py``: a check-in that times out, or entries that differ),
the rank that finds it out is waiting in a check-in; a rank that ran ahead is blocked in some other
collective (a chunk gather or reduction of the engine, the step's norm, the Trainer's gathers,
``all_ranks_agree``), which nothing can interrupt. It fails only when the first rank's connections
go down (its process ends, or destroys its groups), with gloo's "Connection closed by peer": a
transport error that names neither the cause nor the fix, and only once the first rank's process
has ended, by when ``torchrun`` may already have stopped it (0.1 s after the first exit).

So the first rank posts its message on the engine's ``FailureBoard`` (a key of the default process
group's store, which every rank of the job reaches; under ``torchrun`` the launcher's, which
outlives the ranks); if it timed out (the others are elsewhere, the job cannot go on) it then
aborts its process groups (``collectives.abort_groups``), which fails the collectives the others
are blocked in at once; then it raises. A collective that fails inside ``explained()`` (the engine's gloo collectives,
check-ins and barrier; in ``elixir_hf``, the Trainer's entry points) raises the posted
``LockstepError``, the transport error chained as its cause. Ranks whose entries differ all learn
it from the same check-in and keep their groups. On gloo the store is read only once a collective
has failed; the key is the engine's (its lockstep group's name), so an engine built after a caught
failure starts clean.

A collective that fails with nothing posted (gloo's "Connection closed by peer": a rank was killed,
or is ending its process) first lets the heartbeat watch the others (``watch``, set by
``distributed/lockstep.py``): a rank silent for the timeout is named and the job ends; a rank that beats,
or said it left, lets the caller raise its own error. A verdict on a rank that stopped answering
(``STALLED_KEY``) found by a failed collective ends this process too, with the verdict and
``EXIT_STALLED``, as the heartbeat ends the others: every rank of the job exits alike.

On NCCL a rank waiting in a collective (on the GPU; the host blocks in whatever waits for it next)
is woken neither by a peer's abort nor by its exit: its heartbeat thread reads the posted message
instead and ends the process with it (``distributed/heartbeat.py``, [Note: waits nothing releases]).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch.distributed as dist

__all__ = ["EXIT_STALLED", "LockstepError", "FailureBoard", "STALLED_KEY", "end_process"]

STALLED_KEY = "elixir/stalled"
"""The job's verdict on a rank that stopped answering (``distributed/heartbeat.py``), read as any board's."""
EXIT_STALLED = 69
"""The exit status of every rank that stops because another rank stopped answering, or gave up while
this one waited in a collective nothing could release (sysexits.h's ``EX_UNAVAILABLE``); a preempted
run has its own (``elixir_hf.preemption.EXIT_PREEMPTED``)."""


class LockstepError(RuntimeError):
    """The ranks did not start the same engine operation; the message names each rank's and the fix."""


class FailureBoard:
    """Where an engine's ranks leave the reason they gave up (``name``: the same on every rank)."""

    def __init__(self, name: str) -> None:
        self.key = f"elixir/{name}/gave_up"
        self.learned = False
        """Whether this rank raised the posted message (its own or another rank's): it need not be told."""
        self.watch: Callable[[], None] | None = None
        """Watches the others after a failed collective; ends the job if one stopped (``distributed/heartbeat.py``)."""

    def post(self, message: str) -> LockstepError:
        """The error this rank is about to raise, its message first left for the others."""
        store = _store()
        if store is not None:
            with contextlib.suppress(Exception):  # the rank still raises its own error
                store.set(self.key, message)
        self.learned = True
        return LockstepError(message)

    def posted(self) -> str | None:
        """The message a rank gave up with, if there is one (a store gone with the rank that hosted
        it: none)."""
        return _read(self.key)

    def raise_posted(self, exc: BaseException, where: str) -> None:
        """``exc``, a failed collective at ``where``, as the posted ``LockstepError`` if a rank gave
        up; the process ended with ``EXIT_STALLED`` if a rank stopped answering (the job's verdict,
        or the watch's); returns if neither (the caller re-raises ``exc``)."""
        if isinstance(exc, LockstepError) or not isinstance(exc, RuntimeError):
            return  # gloo's transport errors are RuntimeErrors (DistBackendError among them)
        verdict, message = _read(STALLED_KEY), self.posted()
        if verdict is None and message is None and self.watch is not None and _from_a_collective(exc):
            self.watch()  # a rank killed or stopped: named, and the job ends here
            verdict, message = _read(STALLED_KEY), self.posted()
        error = str(exc).strip()[:120]
        if verdict is not None:
            end_process(f"{verdict} [this rank too: {where} failed ({error})]")
        if message is not None:
            self.learned = True
            raise LockstepError(
                f"{message} [raised on this rank too: {where} failed when that rank gave up ({error})]"
            ) from exc

    @contextlib.contextmanager
    def explained(self, where: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            self.raise_posted(exc, where)
            raise


_ending = threading.Lock()


def end_process(message: str) -> NoReturn:
    """Prints ``message`` for this rank and ends its process with ``EXIT_STALLED``: from a thread, or
    where the job cannot go on and the main thread's collectives would wait for a rank that is gone.
    One message: a second thread that gets here waits for the first to end the process."""
    _ending.acquire()
    with contextlib.suppress(Exception):  # what the script printed so far, then the message
        sys.stdout.flush()
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_STALLED)


def _from_a_collective(exc: BaseException) -> bool:
    """gloo's transport errors and torch's distributed ones; not a CUDA OOM or another subclass."""
    return type(exc) is RuntimeError or isinstance(exc, dist.DistError)


def _read(key: str) -> str | None:
    store = _store()
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:  # noqa: BLE001 - no store, no explanation: the caller raises its own error
        return None


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
