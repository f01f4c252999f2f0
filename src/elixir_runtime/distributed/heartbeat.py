"""Stalled ranks named: every rank beats in the job's store; a rank that needs the others and finds
one silent for ``ElixirConfig.lockstep_timeout_s`` ends the job, naming it, with ``EXIT_STALLED``.

A stopped rank (SIGSTOP, ctrl-Z, a debugger's stop, a frozen host or one cut off from the others)
or a killed one (SIGKILL, the OOM killer) answers no collective: the others wait in their next
collective until its timeout (30 minutes by default), which names no rank; on NCCL a killed peer
does not even fail it. So each process of a multi-rank engine beats from a daemon thread ([Note:
stopped, not busy]): every ``period`` (a tenth of the timeout, 0.05 to 5 s) it counts up its key in
the default process group's store (under ``torchrun`` the launcher's, which no rank holds up) and
reads every rank's with one request.

This rank *needs* the others while it is armed: from any engine operation's check-in (a forward,
``state_dict()``, ``full_params``) to the end of its step (``ElixirOptimizer.zero_grad``), and in a
section the caller arms with ``armed()`` (the HF integration: the Trainer's ``train``, ``evaluate``,
``predict``, ``save_model``; Accelerate's ``save_state``, ``load_state``). An armed rank that finds
another rank's count unchanged for ``timeout_s`` posts the verdict in the store (the first rank's
wins), prints it and ends its process with ``EXIT_STALLED``: its main thread is blocked in a
collective with the silent rank, which nothing can interrupt (a gloo abort waits for that rank too),
and the job cannot go on without it. An armed rank that finds a verdict posted does the same, and
so does a rank whose collective failed because a rank left (``distributed/peer_failure.py``): every rank
of the job exits alike. A rank that is not armed (working alone after ``train()``) judges no one,
and a process that ends or destroys its default group says so (``left``; the beat thread notices a
destroyed group at its next beat), so that a rank still finishing is not taken for a silent one.
Not armed, a stopped rank is caught by the collective's own timeout (the HF integration sets it
from ``--ddp_timeout`` on every backend).

[Note: stopped, not busy]
The beat comes from a thread, not from the training loop, so a rank that computes, writes a
checkpoint or waits for the others keeps beating: torch's kernels, collectives, ``torch.save``,
safetensors' writes and ``zlib.crc32`` release the GIL (measured: no gap over 0.05 s in a 600 MB
``save_file``, ``torch.save``, ``torch.load`` or CRC). A count that stops means a process that stopped
running Python threads at all, not one that is slow.

[Note: a connection of its own]
A store client serves one request at a time: a beat sent through the job's store object waits while
the main thread waits in it (``store.wait``, a store-based barrier of ``new_group``), and the others
would take a rank that only waits for a key for a stopped one. So the beat talks to the store
through a clone of it (``Store.clone``: its own connection, the same keys; a store written in
Python that does not implement ``clone`` is shared, and its beat waits behind the main thread's requests).

[Note: the store's host]
A store that a stopped rank hosts itself (rank 0 under ``init_method="env://"`` or ``tcp://``, not
``torchrun``, whose launcher hosts it) answers nobody: every beat thread blocks in its read. A
second thread watches the beat's store requests; one outstanding for the timeout while this rank is
armed ends the process naming the store and, where rank 0 hosts it, rank 0 (the pid and host of its
last beat). Nothing can be posted then: each rank judges alone, and alike.

A store host that is killed (SIGKILL, the OOM killer) closes the store instead: the others'
requests fail at once (``DistNetworkError``), as they would after the host's normal end. So a host
that leaves (at exit, or ending the job) first makes sure the others have read the store since it
said so (``left``, or the verdict): it waits until each other rank has left or beaten twice more
(a beat writes, then reads), at most three beats. A store whose requests fail while its host, rank
0, had not said it left then means a host gone: an armed rank ends the process naming rank 0 (its
beat thread, or the failed collective's watch), and a rank not armed does so once it arms; a rank
that read ``left`` stops watching. The same holds on every backend: the beat thread ends the rank
that a killed peer leaves waiting on NCCL.

[Note: waits nothing releases]
On gloo, a rank that gives up (``distributed/lockstep.py``) aborts its groups, which fails the
collectives the others wait in, and they raise its posted message. On NCCL the wait is on the GPU
(the host blocks in whatever synchronizes next) and neither a peer's abort nor its exit ends it. So
where the engine's collectives are not all gloo, an armed rank's beat also reads its engine's
``FailureBoard``: a message this rank has not raised itself within two beats ends its process with
that message and ``EXIT_STALLED``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing.util
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from .peer_failure import EXIT_STALLED, STALLED_KEY, FailureBoard, end_process

__all__ = ["EXIT_STALLED", "armed", "start", "step_ended", "step_started", "stop_for_silent"]

_LEFT = "left"
_MIN_PERIOD_S, _MAX_PERIOD_S = 0.05, 5.0
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set (``True``) by ``torchrun``, whose launcher hosts the store; else rank 0 hosts it."""

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
    """An engine operation checked in: armed until ``step_ended``."""
    global _in_step
    _in_step = True


def step_ended() -> None:
    global _in_step
    _in_step = False


def _needed() -> bool:
    return bool(_sections or _in_step)


class _Beat:
    """This process's beat thread, the thread watching its store requests, and what they have seen."""

    def __init__(self, store: dist.Store, rank: int, ranks: Sequence[int], timeout_s: float) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.client = _own_connection(store)
        """The beat's own connection to ``store`` ([Note: a connection of its own])."""
        self.board: FailureBoard | None = None
        self.releasable = True
        """Every collective of the engine is gloo's: an abort releases them ([Note: waits nothing releases])."""
        self.keys = {r: f"elixir/beat/{r}" for r in ranks}
        self.me = f"pid {os.getpid()} on {socket.gethostname()}"
        now = time.monotonic()
        self.seen: dict[int, tuple[str, float]] = {r: ("", now) for r in ranks if r != rank}
        """Each other rank's last value and when it changed (this process's clock)."""
        self.count = 0
        self.asking: float | None = None
        """When the beat thread's outstanding store requests began (None: none outstanding)."""
        self.posted_at: float | None = None
        """When the beat first found the board's message ([Note: waits nothing releases])."""
        self.done = threading.Event()
        self.wakeup = threading.Condition()
        """Notified by ``stop`` and ``retime``: the threads' naps end (``_pause``)."""
        self.lock = threading.Lock()  # ``seen``: the beat thread's, and a failed collective's (``stop_for_silent``)
        self._beat()  # the key exists before any rank can read it
        self.thread = threading.Thread(target=self._run, name="elixir-heartbeat", daemon=True)
        self.thread.start()
        self.watcher = threading.Thread(target=self._watch_store, name="elixir-heartbeat-store", daemon=True)
        self.watcher.start()

    @property
    def period(self) -> float:
        return min(max(self.timeout_s / 10, _MIN_PERIOD_S), _MAX_PERIOD_S)

    def stop(self) -> None:
        """Ends the threads and says this process left (a rank finishing later does not wait for it); once."""
        if self.done.is_set():
            return
        self.done.set()
        with self.wakeup:
            self.wakeup.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(self.period + 1)  # not inside a store call when the group is destroyed at exit
        with contextlib.suppress(Exception):  # a store already gone: nobody is left to read it
            self.client.set(self.keys[self.rank], _LEFT)
            self.until_read()

    def retime(self, timeout_s: float) -> None:
        """A new timeout (another engine's): the threads wake to beat at its period, and each rank's
        quiet time counts from now, not from a beat the old period spaced."""
        now = time.monotonic()
        with self.lock:
            self.timeout_s = timeout_s
            self.seen = {r: (value, now) for r, (value, _) in self.seen.items()}
        with self.wakeup:
            self.wakeup.notify_all()

    def _pause(self) -> bool:
        """A period's nap, cut short by ``stop`` or ``retime``; whether the thread goes on."""
        with self.wakeup:
            if not self.done.is_set():
                self.wakeup.wait(self.period)
        return not self.done.is_set()

    def hosted_store(self) -> dist.TCPStore | None:
        """The job's store where rank 0 hosts it (``init_method`` ``env://`` or ``tcp://``, not ``torchrun``)."""
        store = _underlying(self.store)
        if isinstance(store, dist.TCPStore) and os.environ.get(_AGENT_STORE) != "True" and 0 in self.keys:
            return store
        return None

    def until_read(self) -> None:
        """On the store's host: returns once each other rank has read the store since this call ([Note:
        the store's host]): it left, or its count went up twice; a rank silent for the timeout is not
        waited for. At most three beats."""
        if self.rank != 0 or self.hosted_store() is None:
            return
        now = time.monotonic()
        with self.lock:
            waited = [r for r, (value, since) in self.seen.items() if value != _LEFT and now - since < self.timeout_s]
        counts = self.read()
        waited = [r for r in waited if counts.get(r, _LEFT) != _LEFT]
        deadline = now + 3 * self.period
        while waited and time.monotonic() < deadline:
            time.sleep(self.period / 4)
            values = self.read()
            waited = [r for r in waited if values[r] != _LEFT and _count(values[r]) < _count(counts[r]) + 2]

    def _beat(self) -> None:
        self.count += 1
        self.client.set(self.keys[self.rank], f"{self.count} {self.me}")

    def _run(self) -> None:
        gone = None  # the verdict on the store's host, gone: this rank ends once it needs the others
        while self._pause():
            if not (dist.is_initialized() and dist.distributed_c10d._get_default_store() is self.store):
                self.stop()  # the group this beat belongs to was destroyed
                return
            if gone is None:
                self.asking = time.monotonic()
                try:
                    verdict, unreleased = self._look()
                except Exception as exc:  # noqa: BLE001 - a store request failed
                    verdict = unreleased = None
                    gone = self.host_gone(exc)
                    if gone is None:  # the store went with the job's end: nothing to watch
                        return
                finally:
                    self.asking = None
                if verdict is not None:
                    self.stop_job(verdict)
                if unreleased is not None:
                    end_process(unreleased)
            if gone is not None and _needed():
                end_process(gone)

    def _look(self) -> tuple[str | None, str | None]:
        """One beat: this rank's count up and the others' read; where this rank needs them, the verdict
        to end the job with, or the message it waits on unreleased."""
        self._beat()
        values = self.read()
        if self.done.is_set() or not _needed():
            return None, None
        verdict = self._posted() or self.judge(values, self.timeout_s)
        return verdict, None if verdict is not None else self._unreleased()

    def _watch_store(self) -> None:
        """[Note: the store's host]: a beat whose requests have not returned for the timeout."""
        while self._pause():
            if not self.thread.is_alive():
                return
            since = self.asking
            if since is None or not _needed() or time.monotonic() - since < self.timeout_s:
                continue
            time.sleep(self.period)  # a beat thread only starved of the GIL returns meanwhile
            if self.asking == since and not self.done.is_set():
                end_process(self._unreachable(time.monotonic() - since))

    def read(self) -> dict[int, str]:
        """Every other rank's value (all keys exist once every rank has started; until then, none)."""
        others = list(self.seen)
        keys = [self.keys[r] for r in others]
        if not self.client.check(keys):
            return {}
        values = dict(zip(others, (v.decode() for v in self.client.multi_get(keys))))
        now = time.monotonic()
        with self.lock:
            for r, value in values.items():
                if value != self.seen[r][0]:
                    self.seen[r] = (value, now)
        return values

    def _posted(self) -> str | None:
        return self.client.get(STALLED_KEY).decode() if self.client.check([STALLED_KEY]) else None

    def _unreleased(self) -> str | None:
        """[Note: waits nothing releases]: the board's message, once this rank has left it unraised for two beats."""
        if self.releasable or self.board is None or self.board.learned:
            return None
        message = self.board.posted()
        if message is None:
            self.posted_at = None
            return None
        self.posted_at = self.posted_at or time.monotonic()
        if time.monotonic() - self.posted_at < 2 * self.period:  # the main thread may be about to raise it
            return None
        return (
            f"{message} [rank {self.rank} ends too (exit status {EXIT_STALLED}): it waited in a collective on NCCL, "
            "which that rank's error cannot release]"
        )

    def stop_job(self, verdict: str) -> None:
        """Posts ``verdict`` (or takes the one posted first), prints it and ends this process."""
        with contextlib.suppress(Exception):
            verdict = self.client.compare_set(STALLED_KEY, "", verdict).decode()
            self.until_read()  # the store may be this process's: the others read the verdict first
        end_process(verdict)

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
            f"ElixirConfig.lockstep_timeout_s={self.timeout_s:g}) {self._needed_by()}. {_STOPPED} {_RESUME}"
        )

    def _unreachable(self, quiet: float) -> str:
        """The verdict on a store that stopped answering ([Note: the store's host])."""
        waited = f"for {quiet:.1f} s; ElixirConfig.lockstep_timeout_s={self.timeout_s:g}"
        if self.hosted_store() is not None and self.rank != 0:
            return f"{self._host()} has not answered ({waited}) {self._needed_by()}. {_STOPPED} {_TORCHRUN} {_RESUME}"
        store = _underlying(self.store)
        where = f"{type(store).__name__} at {store.host}:{store.port}" if isinstance(store, dist.TCPStore) else ""
        host = "the launcher (torchrun) hosts it" if os.environ.get(_AGENT_STORE) == "True" else "its host"
        return (
            f"Elixir: the job's store ({where or type(store).__name__}; {host}) has not answered ({waited}) "
            f"{self._needed_by()}. Its process is stopped or hung, or its host is unreachable; every rank needs it, so "
            f"every rank stops (exit status {EXIT_STALLED}). {_RESUME}"
        )

    def host_gone(self, exc: BaseException) -> str | None:
        """The verdict on a store request that failed (``exc``) because its host, rank 0, is gone without
        saying it left ([Note: the store's host]); None otherwise (the store went with the job's end)."""
        if not isinstance(exc, dist.DistNetworkError) or self.rank == 0 or self.hosted_store() is None:
            return None
        with self.lock:
            if self.seen[0][0] == _LEFT:
                return None
        error = (str(exc).strip().splitlines() or [""])[0][:160]
        return (
            f"{self._host()} is gone: its store closed the connection ({type(exc).__name__}: {error}) "
            f"{self._needed_by()}, and rank 0 had not left the job. {_GONE} {_TORCHRUN} {_RESUME}"
        )

    def _host(self) -> str:
        """Rank 0 as the store's host, for a verdict ([Note: the store's host])."""
        store = self.hosted_store()
        assert store is not None, "asked only where rank 0 hosts the store"
        where = f"{type(store).__name__} at {store.host}:{store.port}"
        with self.lock:
            host = self.seen[0][0].partition(" ")[2] or "its pid not read yet"
        return (
            f"Elixir: a rank stopped answering: rank 0 ({host}), which hosts the job's store ({where}: torch starts "
            "it on rank 0 under init_method env:// and tcp://),"
        )

    def _needed_by(self) -> str:
        return f"while rank {self.rank} needed it in a step or a save"


_STOPPED = (
    "Its process is stopped (SIGSTOP, ctrl-Z, a debugger), killed, or hung outside Python, or its host is unreachable; "
    f"every collective needs it, so every rank stops (exit status {EXIT_STALLED})."
)
_GONE = (
    "Its process was killed (SIGKILL, the OOM killer) or crashed, or its host went down; every collective needs it, "
    f"so every rank stops (exit status {EXIT_STALLED})."
)
_TORCHRUN = "(Under torchrun the launcher hosts the store, and a stopped or killed rank 0 is named like any rank.)"
_RESUME = "Resume from the newest complete checkpoint (resume_from_checkpoint=True) once every rank runs."


def _count(value: str) -> int:
    """A beat's count (``"<count> pid <pid> on <host>"``)."""
    return int(value.partition(" ")[0])


def _moved(before: str, now: str) -> bool:
    """A rank beat since ``before``, its value at the failure (``_LEFT`` where it had left, or had no key yet)."""
    return before == _LEFT or _count(now) > _count(before)


def _own_connection(store: dist.Store) -> dist.Store:
    """``store`` through a connection of its own ([Note: a connection of its own]); a store written in
    Python that cannot clone itself (torch's ``Store.clone`` is its to implement) is shared."""
    try:
        return store.clone()  # type: ignore[attr-defined, no-any-return]  # torch's stub lacks it (2.8 on)
    except RuntimeError:  # "Tried to call pure virtual function ... clone"
        return store


def _underlying(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


_beat: _Beat | None = None


def start(ranks: Sequence[int], timeout_s: float, board: FailureBoard, group: dist.ProcessGroup | None) -> None:
    """This process beats, and watches ``ranks`` (global ranks, this one among them), from now on: a
    multi-rank engine calls it once built (``distributed/lockstep.py``) with its ``FailureBoard`` and the
    group of its collectives. Another engine on the same process group replaces the timeout and the
    board; one on a new process group starts a new beat."""
    global _beat
    store = dist.distributed_c10d._get_default_store()
    if _beat is None or _beat.store is not store or set(_beat.keys) != set(ranks):
        if _beat is not None:
            _beat.stop()
        _beat = _Beat(store, dist.get_rank(), ranks, timeout_s)
        _leave_at_exit()
    if timeout_s != _beat.timeout_s:
        _beat.retime(timeout_s)
    _beat.board, _beat.posted_at = board, None
    _beat.releasable = {dist.get_backend(), dist.get_backend(group)} == {"gloo"}


def stop_for_silent() -> None:
    """Where a collective with the others failed (armed or not): watches them until each has beaten
    since (its count in the store above the one there at the failure) or said it left (the caller
    then raises its own error), or ends the job as the beat thread would if one has been silent for
    the timeout or a verdict is posted. At most the timeout and two beats: a rank killed just before
    the failure is named."""
    if _beat is None:
        return
    deadline = time.monotonic() + _beat.timeout_s + 2 * _beat.period
    with armed():  # the store's watcher covers this wait too ([Note: the store's host])
        try:
            # The counts as the failure left them, read from the store: a rank killed just before it
            # may have beaten last after this rank's previous read, and must not count as answering.
            failed = _beat.read()
            while True:
                values = _beat.read()
                verdict = _beat._posted() or _beat.judge(values, _beat.timeout_s)
                if verdict is not None:
                    _beat.stop_job(verdict)
                answered = all(value == _LEFT or _moved(failed.get(r, _LEFT), value) for r, value in values.items())
                if (values and answered) or time.monotonic() > deadline:
                    return
                time.sleep(_beat.period)
        except Exception as exc:  # noqa: BLE001 - a store request failed
            gone = _beat.host_gone(exc)
            if gone is not None:
                end_process(gone)
            return  # no store, as at the job's end: the caller raises its own error


@functools.cache
def _leave_at_exit() -> None:
    """At exit this process says it left (before ``_destroy_groups``: atexit runs in reverse order); a
    ``multiprocessing`` child (``torch.multiprocessing.spawn``) ends without atexit, with its finalizers."""
    atexit.register(_leave)
    multiprocessing.util.Finalize(None, _leave, exitpriority=0)


def _leave() -> None:
    if _beat is not None:
        _beat.stop()
