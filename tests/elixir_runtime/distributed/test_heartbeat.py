"""The beat without processes: a store, this rank's ``_Beat`` (its thread stopped: there is no process
group), the other rank's beats written into the store by the test, and a clock the test moves."""

from __future__ import annotations

import threading
import types
from datetime import timedelta

import pytest
import torch.distributed as dist

from elixir_runtime.distributed import heartbeat


class Ended(BaseException):
    """``end_process`` here (a BaseException: the watch catches a failed store request's Exception)."""


class Clock:
    """``heartbeat``'s ``time``: ``sleep`` moves ``monotonic`` on at once and records the naps."""

    def __init__(self) -> None:
        self.now, self.naps = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


def _beat(store: dist.Store) -> heartbeat._Beat:
    one = heartbeat._Beat(store, rank=0, ranks=[0, 1], timeout_s=5.0)  # a beat every 0.5 s: whole numbers on the clock
    one.thread.join()
    one.watcher.join()
    return one


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(heartbeat, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(heartbeat, "end_process", lambda message: (_ for _ in ()).throw(Ended(message)))
    return clock


@pytest.fixture
def beat(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> heartbeat._Beat:
    one = _beat(dist.HashStore())
    monkeypatch.setattr(heartbeat, "_beat", one)
    return one


def test_a_rank_killed_after_its_last_beat_was_read_is_named(beat, clock) -> None:
    """The killed rank beat once more between this rank's last read and its death: the watch must
    not take that beat, first seen after the failure, for an answer."""
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    beat.read()  # this rank's last read before the failure
    beat.store.set(beat.keys[1], "4 pid 7 on host")  # its last beat, then SIGKILL
    failed = clock.now
    with pytest.raises(Ended, match=r"rank 1 \(pid 7 on host\) for 5\.0 s"):
        heartbeat.stop_for_silent()
    assert clock.now - failed == pytest.approx(beat.timeout_s)  # named after the timeout, not before


def test_a_rank_that_beats_after_the_failure_lets_the_caller_raise(beat, clock, monkeypatch) -> None:
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    beat.read()
    reads = []

    def read() -> dict[int, str]:  # rank 1 beats after the watch's second read
        reads.append(clock.now)
        if len(reads) == 3:
            beat.store.set(beat.keys[1], "4 pid 7 on host")
        return heartbeat._Beat.read(beat)

    monkeypatch.setattr(beat, "read", read)
    heartbeat.stop_for_silent()  # returns: the caller raises its own error
    assert len(reads) == 3 and clock.naps == [beat.period]


def test_a_rank_that_left_lets_the_caller_raise_at_once(beat, clock) -> None:
    beat.store.set(beat.keys[1], "left")
    heartbeat.stop_for_silent()
    assert clock.naps == []


def test_a_posted_verdict_ends_the_watching_rank_with_it(beat, clock) -> None:
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    beat.store.set(heartbeat.STALLED_KEY, "Elixir: rank 1 stopped answering")
    with pytest.raises(Ended, match="rank 1 stopped answering"):
        heartbeat.stop_for_silent()


def test_the_beat_is_not_held_up_by_a_wait_on_the_jobs_store(clock) -> None:
    """[Note: a connection of its own]: the main thread waits on the job's store for a key that only a
    beat's request, from another thread, lets be set. On one shared connection the beat would queue
    behind the wait, and the wait would end in its timeout (DistStoreError)."""
    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    store = dist.PrefixStore("default_pg", host)
    beat = _beat(store)
    events = []

    def other_thread() -> None:
        beat._beat()
        events.append("beat")
        beat.client.set("released", "1")

    thread = threading.Thread(target=other_thread)
    store.set(beat.keys[1], "1 pid 7 on host")
    thread.start()
    store.wait(["released"])
    events.append("wait returned")
    thread.join()
    assert events == ["beat", "wait returned"]
    assert store.get(beat.keys[0]).decode().startswith(f"{beat.count} pid ")


def test_a_new_timeout_counts_each_ranks_quiet_time_from_when_it_was_set(beat, clock) -> None:
    """An engine with a shorter timeout than the last: a beat its old period (2.5 s here) spaced is not
    silence under the new one."""
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    values = beat.read()
    clock.now += 2.0
    assert beat.judge(values, 1.0) is not None  # what the old clocks would say
    beat.retime(1.0)
    assert beat.judge(values, 1.0) is None
    clock.now += 1.0
    assert "rank 1 (pid 7 on host) for 1.0 s" in beat.judge(values, 1.0)


class _Nap(threading.Condition):
    """The beat's ``wakeup``: a nap waits for a notification only (no timeout), and is recorded."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def wait(self, timeout: float | None = None) -> bool:
        self.events.append(f"nap {timeout:g} s")
        woken = super().wait()
        self.events.append("woken")
        return woken


@pytest.mark.parametrize("how", ["retime", "stop"])
def test_a_nap_ends_at_a_new_timeout_or_the_stop(beat, how) -> None:
    """The beat thread naps a period of the old timeout (5 s at 50 s): a new timeout wakes it to beat at
    the new period, and ``stop`` ends it, without waiting the nap out."""
    events: list[str] = []
    beat.done.clear()
    beat.timeout_s, beat.wakeup = 50.0, _Nap(events)
    going_on = []
    thread = threading.Thread(target=lambda: going_on.append(beat._pause()))
    thread.start()
    while not events:  # the thread is in its nap (the condition's lock released)
        thread.join(0.01)
    beat.retime(1.0) if how == "retime" else beat.stop()
    thread.join()  # a nap nothing ends would hang here, until pytest's timeout
    assert events == ["nap 5 s", "woken"] and going_on == [how == "retime"]


class _PythonStore(dist.Store):
    """A store written in Python, as some launchers bring: it does not implement ``clone``."""

    def set(self, key: str, value: str) -> None:
        pass


def test_a_store_that_cannot_clone_itself_is_shared() -> None:
    store = _PythonStore()
    assert heartbeat._own_connection(store) is store
    tcp = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    assert heartbeat._own_connection(tcp) is not tcp
