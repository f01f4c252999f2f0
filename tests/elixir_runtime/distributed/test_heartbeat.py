"""The watch a failed collective starts (``heartbeat.stop_for_silent``), without processes: a store
and this rank's beat, the other rank's beats written into the store by the test."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elixir_runtime.distributed import heartbeat


class Ended(BaseException):
    """``end_process`` here (a BaseException: the watch catches a failed store request's Exception)."""


@pytest.fixture
def beat(monkeypatch: pytest.MonkeyPatch):
    store = dist.HashStore()
    one = heartbeat._Beat(store, rank=0, ranks=[0, 1], timeout_s=3.0)  # no process group: its thread stops
    one.thread.join()
    monkeypatch.setattr(heartbeat, "_beat", one)
    monkeypatch.setattr(heartbeat, "end_process", lambda message: (_ for _ in ()).throw(Ended(message)))
    return one


def test_a_rank_killed_after_its_last_beat_was_read_is_named(beat) -> None:
    """The killed rank beat once more between this rank's last read and its death: the watch must
    not take that beat, first seen after the failure, for an answer."""
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    beat.read()  # this rank's last read before the failure
    beat.store.set(beat.keys[1], "4 pid 7 on host")  # its last beat, then SIGKILL
    with pytest.raises(Ended, match=r"rank 1 \(pid 7 on host\)"):
        heartbeat.stop_for_silent()


def test_a_rank_that_beats_after_the_failure_lets_the_caller_raise(beat, monkeypatch) -> None:
    beat.store.set(beat.keys[1], "3 pid 7 on host")
    beat.read()
    reads = []

    def read() -> dict[int, str]:  # rank 1 beats after the failure's first read
        reads.append(None)
        if len(reads) == 2:
            beat.store.set(beat.keys[1], "4 pid 7 on host")
        return heartbeat._Beat.read(beat)

    monkeypatch.setattr(beat, "read", read)
    heartbeat.stop_for_silent()  # returns: the caller raises its own error
    assert len(reads) == 2
