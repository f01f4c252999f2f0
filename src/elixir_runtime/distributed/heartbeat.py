"""Stalled ranks named: every rank beats in the job's store; a rank that needs the others and finds
one silent for ``ElixirConfig.lockstep_timeout_s`` ends the job, naming it, with ``EXIT_STALLED``.

A stopped rank (SIGSTOP, ctrl-Z, a debugger's stop, a frozen host or one cut off from the others)
answers no collective and raises nothing: the others wait in their next collective until its
timeout (30 minutes by default), and a collective's timeout names no rank. So each process of a
multi-rank engine beats from a daemon thread ([Note: stopped, not busy]): every ``period`` (a tenth
of the timeout, 0.05 to 5 s) it counts up its key in the default process group's store (under
``torchrun`` the launcher's, which no rank holds up) and reads every rank's with one request.

This rank *needs* the others while it is armed: inside an engine step (from a training forward's
check-in to ``ElixirOptimizer.zero_grad``) or a section the caller arms with ``armed()`` (the HF
integration: the Trainer's ``train``, ``evaluate``, ``predict``, ``save_model``; Accelerate's
``save_state``, ``load_state``). An armed rank that finds another rank's count unchanged for
``timeout_s`` posts the verdict in the store (the first rank's wins), prints it and ends its
process with ``EXIT_STALLED``: its main thread is blocked in a collective with the silent rank,
which nothing can interrupt (a gloo abort waits for that rank too), and the job cannot go on
without it. An armed rank that finds a verdict posted does
the same; a rank whose collective failed first because a stopping rank left raises the verdict as
its ``LockstepError`` (``distributed/peer_failure.py``). A rank that is not armed (working alone after
``train()``) judges no one, and a process that ends or destroys its default group says so
(``left``; the beat thread notices a destroyed group at its next beat), so that a rank still
finishing is not taken for a silent one. Not armed, a stopped rank is caught by the
collective's own timeout (the HF integration sets it from ``--ddp_timeout`` on every backend).

[Note: stopped, not busy]
The beat comes from a thread, not from the training loop, so a rank that computes, writes a
checkpoint or waits for the others keeps beating: torch's kernels, collectives, ``torch.save``,
safetensors' writes and ``zlib.crc32`` release the GIL (measured: no gap over 0.05 s in a 600 MB
``save_file``, ``torch.save``, ``torch.load`` or CRC). A count that stops means a process that stopped
running Python threads at all, not one that is slow. A store that the stopped rank hosts itself (a
``tcp://`` rank-0 store, not ``torchrun``'s) blocks the beats of all: then the collectives' timeout is
what ends the job.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from .peer_failure import STALLED_KEY

__all__ = ["EXIT_STALLED", "armed", "start", "step_ended", "step_started", "stop_for_silent"]

EXIT_STALLED = 69
"""The exit status of every rank that stops because another rank stopped answering (sysexits.h's
``EX_UNAVAILABLE``); a preempted run has its own (``elixir_hf.preemption.EXIT_PREEMPTED``)."""

_LEFT = "left"
_MIN_PERIOD_S, _MAX_PERIOD_S = 0.05, 5.0

_sections = 0
"""``armed()`` sections this process is inside (the main thread's; the beat thread reads it)."""
_in_step = False


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Inside, this rank needs the others: a rank silent for the timeout ends the job. A decorator too."""
    global _sections
    _sections += 1
    try:
        yield
    finally:
        _sections -= 1


def step_started() -> None:
    """A training forward checked in: armed until ``step_ended``."""
    global _in_step
    _in_step = True


def step_ended() -> None:
    global _in_step
    _in_step = False


class _Beat:
    """This process's beat thread and what it has seen of the others."""

    def __init__(self, store: dist.Store, rank: int, ranks: Sequence[int], timeout_s: float) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.keys = {r: f"elixir/beat/{r}" for r in ranks}
        self.me = f"pid {os.getpid()} on {socket.gethostname()}"
        now = time.monotonic()
        self.seen: dict[int, tuple[str, float]] = {r: ("", now) for r in ranks if r != rank}
        """Each other rank's last value and when it changed (this process's clock)."""
        self.count = 0
        self.done = threading.Event()
        self.lock = threading.Lock()  # ``seen``: the beat thread's, and a failed check-in's (``stop_for_silent``)
        self._beat()  # the key exists before any rank can read it
        self.thread = threading.Thread(target=self._run, name="elixir-heartbeat", daemon=True)
        self.thread.start()

    @property
    def period(self) -> float:
        return min(max(self.timeout_s / 10, _MIN_PERIOD_S), _MAX_PERIOD_S)

    def stop(self) -> None:
        """Ends the thread and says this process left (a rank finishing later does not wait for it)."""
        self.done.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(self.period + 1)  # not inside a store call when the group is destroyed at exit
        with contextlib.suppress(Exception):  # a store already gone: nobody is left to read it
            self.store.set(self.keys[self.rank], _LEFT)

    def _beat(self) -> None:
        self.count += 1
        self.store.set(self.keys[self.rank], f"{self.count} {self.me}")

    def _run(self) -> None:
        while not self.done.wait(self.period):
            if not (dist.is_initialized() and dist.distributed_c10d._get_default_store() is self.store):
                self.stop()  # the group this beat belongs to was destroyed
                return
            try:
                self._beat()
                values = self.read()
                if self.done.is_set() or not (_sections or _in_step):
                    continue
                verdict = self._posted() or self.judge(values, self.timeout_s)
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing to watch
                return
            if verdict is not None:
                self.stop_job(verdict)

    def read(self) -> dict[int, str]:
        """Every other rank's value (all keys exist once every rank has started; until then, none)."""
        others = list(self.seen)
        keys = [self.keys[r] for r in others]
        if not self.store.check(keys):
            return {}
        values = dict(zip(others, (v.decode() for v in self.store.multi_get(keys))))
        now = time.monotonic()
        with self.lock:
            for r, value in values.items():
                if value != self.seen[r][0]:
                    self.seen[r] = (value, now)
        return values

    def _posted(self) -> str | None:
        return self.store.get(STALLED_KEY).decode() if self.store.check([STALLED_KEY]) else None

    def stop_job(self, verdict: str) -> None:
        """Posts ``verdict`` (or takes the one posted first), prints it and ends this process."""
        with contextlib.suppress(Exception):
            verdict = self.store.compare_set(STALLED_KEY, "", verdict).decode()
        with contextlib.suppress(Exception):  # what the script printed so far, then the verdict
            sys.stdout.flush()
        print(f"[rank {self.rank}] {verdict}", file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)

    def judge(self, values: dict[int, str], quiet_s: float) -> str | None:
        """The verdict naming each rank (pid, host) whose count has not moved for ``quiet_s``, if any."""
        now = time.monotonic()
        with self.lock:
            silent = [
                (r, value.partition(" ")[2], now - since)
                for r, (value, since) in self.seen.items()
                if values and values[r] != _LEFT and now - since >= quiet_s
            ]
        if not silent:
            return None
        who = "; ".join(f"rank {r} ({where}) for {quiet:.1f} s" for r, where, quiet in silent)
        return (
            f"Elixir: a rank stopped answering: its heartbeat has not advanced ({who}; "
            f"ElixirConfig.lockstep_timeout_s={self.timeout_s:g}) while rank {self.rank} needed it in a step or a "
            "save. Its process is stopped (SIGSTOP, ctrl-Z, a debugger) or hung outside Python, or its host is "
            f"unreachable; every collective needs it, so every rank stops (exit status {EXIT_STALLED}). Resume from "
            "the newest complete checkpoint (resume_from_checkpoint=True) once every rank runs."
        )


_beat: _Beat | None = None


def start(ranks: Sequence[int], timeout_s: float) -> None:
    """This process beats, and watches ``ranks`` (global ranks, this one among them), from now on: a
    multi-rank engine calls it once built (``distributed/lockstep.py``). Another engine on the same
    process group replaces the timeout; one on a new process group starts a new beat."""
    global _beat
    store = dist.distributed_c10d._get_default_store()
    if _beat is not None and _beat.store is store and set(_beat.keys) == set(ranks):
        _beat.timeout_s = timeout_s
        return
    if _beat is not None:
        _beat.stop()
    _beat = _Beat(store, dist.get_rank(), ranks, timeout_s)
    _leave_at_exit()


def stop_for_silent() -> None:
    """Where a collective with the others timed out (a check-in, armed or not): if a rank has been
    silent for the timeout, ends the job naming it, as the beat thread would. A rank silent for half
    of it is watched until it beats again or reaches the timeout (at most the timeout more); one that
    beats returns at once, and the caller raises its own error."""
    if _beat is None:
        return
    deadline = time.monotonic() + _beat.timeout_s
    try:
        while True:
            values = _beat.read()
            verdict = _beat.judge(values, _beat.timeout_s)
            if verdict is not None:
                _beat.stop_job(verdict)
            if _beat.judge(values, _beat.timeout_s / 2) is None or time.monotonic() > deadline:
                return
            time.sleep(_beat.period)
    except Exception:  # noqa: BLE001 - no store: the caller raises its own error
        return


@functools.cache
def _leave_at_exit() -> None:
    """At exit this process says it left (before ``_destroy_groups``: atexit runs in reverse order)."""
    atexit.register(lambda: _beat is not None and _beat.stop())
