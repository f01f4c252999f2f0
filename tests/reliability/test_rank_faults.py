"""Faults of one rank of a multi-rank ElixirTrainer job, on 2 gloo ranks on the CPU and on 2 NCCL ranks
with a GPU each (marked ``gpu``; ``make test-gpu``): a forward or a save on one rank only, a rank
stopped (SIGSTOP) or killed (SIGKILL) inside a step or a save, a stopped or killed rank 0 that hosts the
job's store, and (gloo) one of three ranks stopped. Each ends every rank within the lockstep timeout (2 or
3 s, plus teardown) with the Elixir message, every rank that waited for a stopped or killed one with
exit status 69, and the newest complete checkpoint resumes bit for bit as the uninterrupted run. A
store host that ends normally is not taken for a killed one (bare ranks beating, no Trainer).

The ranks are started here with ``torchrun``'s environment but not its teardown (``launch.run_ranks``):
``torchrun`` stops every rank once one exits, which would hide how each rank ends by itself. With
``ELIXIR_FAULT_TIMES=path`` each scenario's seconds from the fault to each rank's end are recorded
there (JSON, by scenario and backend; docs/hf.md, "Faults: what you see").

Before: on gloo, a killed rank made the others raise gloo's "Connection closed by peer", naming no
rank; on NCCL, every one of these left the other rank waiting until ``--ddp_timeout`` (or the launcher)
ended it; with three ranks, a rank whose collective failed when the first exited raised (exit status
1) instead of 69; a stopped rank 0 hosting the store left the others waiting until ``--ddp_timeout``,
and a killed one made them raise gloo's "Connection reset by peer" (on NCCL: wait until ``--ddp_timeout``)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
from pathlib import Path

import pytest
import torch
from launch import RankEnd, run_ranks
from safetensors.torch import load_file
from stall_worker import DDP_TIMEOUT

from elixir_runtime.distributed.heartbeat import EXIT_STALLED

BACKENDS = [pytest.param(False, id="gloo"), pytest.param(True, id="nccl", marks=pytest.mark.gpu)]
SLACK_S = 10
"""Seconds past the lockstep timeout a rank may take to give up: the beats, a loaded machine."""
EXIT_SLACK_S = 60
"""Seconds past it a rank that raised may take to end its process (its atexit handlers and the interpreter's
teardown: 0.2-0.3 s on an idle 2-core host since the heap is frozen at exit, more with the cores busy)."""
STALLS = [("stop", "step"), ("stop", "save"), ("kill", "step"), ("kill", "save")]


def _run(cuda: bool, script: str, *args: str, **kwargs) -> list[RankEnd]:
    if cuda and torch.cuda.device_count() < 2:
        pytest.skip(f"2 NCCL ranks need 2 GPUs; this machine has {torch.cuda.device_count()}")
    return run_ranks(script, *args, cuda=cuda, timeout=300, **kwargs)


def _timed(scenario: str, cuda: bool, since: float, ends: list[RankEnd], timeout_s: float, raised=()) -> list[float]:
    """Each rank's seconds from ``since`` (the fault) to its error (``raised[rank]``, the time it raised,
    else its end), checked against the timeout and recorded in ``ELIXIR_FAULT_TIMES`` if set."""
    error = [
        round((raised[r] if r < len(raised) and raised[r] else end.ended) - since, 2) for r, end in enumerate(ends)
    ]
    ended = [round(end.ended - since, 2) for end in ends]
    path = os.environ.get("ELIXIR_FAULT_TIMES")
    if path:
        times = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
        times[f"{scenario} [{'nccl' if cuda else 'gloo'}]"] = {
            "fault_to_error_s": error,
            "fault_to_exit_s": ended,
            "exit_status": [end.returncode for end in ends],
            "lockstep_timeout_s": timeout_s,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        }
        Path(path).write_text(json.dumps(times, indent=1))
    assert max(error) < timeout_s + SLACK_S and max(ended) < timeout_s + EXIT_SLACK_S, (error, ended)
    return error


def _verdict(end: RankEnd, rank: int) -> str:
    """What rank ``rank`` printed as it ended the job (exit status 69), the Elixir message."""
    assert end.returncode == EXIT_STALLED, f"rank {rank} exited {end.returncode}:\n{end.stderr[-3000:]}"
    (verdict,) = re.findall(rf"^\[rank {rank}\] (Elixir: .*)$", end.stderr, flags=re.M)
    return verdict


# --------------------------------------------------------------------------- one rank only


@pytest.mark.parametrize("cuda", BACKENDS)
@pytest.mark.parametrize("what", ["forward", "save"])
def test_a_forward_or_save_on_one_rank_ends_every_rank_with_the_lockstep_error(tmp_path, cuda: bool, what: str) -> None:
    """Rank 0 alone runs a forward (or ``save_model``) from a callback while rank 1 goes on into the
    Trainer's next step (its gathers). On gloo both raise rank 0's ``LockstepError`` (rank 0's abort
    fails rank 1's gather); on NCCL nothing releases rank 1's gather, and it ends with the same
    message and exit status 69."""
    ends = _run(cuda, "diverge_worker.py", str(tmp_path), what)
    op = "a no-grad forward" if what == "forward" else "state_dict() (gathering the weights)"
    raised = [None] * len(ends)
    for rank, end in enumerate(ends):
        report = tmp_path / f"rank{rank}.json"
        if report.exists():
            message = json.loads(report.read_text())
            assert message["type"] == "LockstepError", (rank, message)
            message, raised[rank] = message["message"], message["time"]
        else:
            assert cuda and rank == 1, f"rank {rank} raised nothing:\n{end.stderr[-3000:]}"
            message = _verdict(end, rank)
            assert f"rank 1 ends too (exit status {EXIT_STALLED}): it waited in a collective on NCCL" in message
        assert "rank 0 start" in message and op in message and "full_params" in message, (rank, message)
    _timed(f"{what} on one rank", cuda, float((tmp_path / "diverged").read_text()), ends, 2, raised)


# --------------------------------------------------------------------------- a rank stops answering


JOBS_AT_ONCE = 2
"""Independent jobs run side by side: two 2-rank jobs keep a 2-core host's cores busy (each rank idles in
its imports' I/O and its gathers) without starving a rank's beat thread for the 3 s timeout."""


@pytest.fixture(scope="module", params=BACKENDS)
def stalled(request, tmp_path_factory) -> tuple[bool, Path, dict[tuple[str, str], list[RankEnd]]]:
    """Each of ``STALLS`` on its own job (rank 1 stopped or killed inside step 3 or the save of
    ``checkpoint-4``), in ``<out>/<fault>-<where>``; on the CPU ``JOBS_AT_ONCE`` jobs at a time (each job
    times its ranks from its own fault), on GPUs one at a time (a job takes both)."""
    cuda, out = request.param, tmp_path_factory.mktemp("stalled")

    def job(stall: tuple[str, str]) -> list[RankEnd]:
        how, where = stall
        (out / f"{how}-{where}").mkdir()
        return _run(cuda, "stall_worker.py", str(out / f"{how}-{where}"), how, where, "1")

    with concurrent.futures.ThreadPoolExecutor(1 if cuda else JOBS_AT_ONCE) as pool:
        ends = dict(zip(STALLS, pool.map(job, STALLS)))
    return cuda, out, ends


@pytest.mark.parametrize("how, where", STALLS)
def test_a_stopped_or_killed_rank_is_named_and_every_rank_ends(stalled, how: str, where: str) -> None:
    cuda, out, ends = stalled
    folder, (waiting, faulty) = out / f"{how}-{where}", ends[how, where]
    assert (folder / "fault").is_file(), waiting.stderr[-3000:]
    assert json.loads((folder / "waiting.json").read_text())["ddp_timeout_s"] == DDP_TIMEOUT  # every backend
    verdict = _verdict(waiting, 0)
    assert re.search(r"\(rank 1 \(pid \d+ on [^)]+\) for \d+\.\d s; ElixirConfig.lockstep_timeout_s=3\)", verdict)
    assert f"every collective needs it, so every rank stops (exit status {EXIT_STALLED})" in verdict
    assert faulty.returncode == -9  # killed, or stopped and killed once rank 0 had ended
    _timed(f"{how} rank 1 mid-{where}", cuda, float((folder / "fault").read_text()), ends[how, where], 3)


def test_the_newest_complete_checkpoint_resumes_bit_for_bit(stalled) -> None:
    """Each stopped or killed job resumed from ``checkpoint-2`` (a save cut short left ``checkpoint-4``
    torn) logs the uninterrupted run's losses and saves its ``checkpoint-4`` bit for bit."""
    cuda, out, _ = stalled
    folders = [str(out / f"{how}-{where}") for how, where in STALLS]
    ends = _run(cuda, "stall_worker.py", str(out), "resume", *folders)
    assert all(end.returncode == 0 for end in ends), ends[0].stderr[-3000:]
    losses = json.loads((out / "losses.json").read_text())
    want = out / "straight" / "checkpoint-4"
    for folder in folders:
        assert losses[folder] == losses["straight"][2:], folder
        for name in (
            "model.safetensors",
            "optimizer-00000-of-00002.safetensors",
            "optimizer-00001-of-00002.safetensors",
        ):
            a, b = load_file(str(Path(folder) / "checkpoint-4" / name)), load_file(str(want / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, name)


@pytest.mark.parametrize("cuda", BACKENDS)
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stopped_or_killed_rank_0_that_hosts_the_store_is_named(tmp_path, cuda: bool, how: str) -> None:
    """Without ``torchrun`` (``init_method="env://"``) rank 0 hosts the job's store. Stopped, it
    answers no beat, and rank 1 names it from its store requests that do not return; killed, its
    store closes without rank 0 having said it left, and rank 1 names it from the requests that fail
    (its beat's, or its failed gather's watch)."""
    ends = _run(cuda, "stall_worker.py", str(tmp_path), how, "step", "0", store="rank0")
    verdict = _verdict(ends[1], 1)
    assert re.search(
        r"rank 0 \(pid \d+ on [^)]+\), which hosts the job's store \(TCPStore at 127\.0\.0\.1:\d+", verdict
    )
    if how == "stop":
        assert "has not answered (for" in verdict and "lockstep_timeout_s=3" in verdict, verdict
    else:
        assert "is gone: its store closed the connection (DistNetworkError: " in verdict, verdict
        assert "rank 0 had not left the job" in verdict and "killed (SIGKILL, the OOM killer)" in verdict, verdict
    assert ends[0].returncode == -9  # killed, or stopped and killed once rank 1 had ended
    _timed(f"{how} rank 0, the store's host", cuda, float((tmp_path / "fault").read_text()), ends, 3)


def test_a_store_host_that_ends_normally_is_not_taken_for_a_killed_one() -> None:
    """Rank 0 hosts the store and ends its process normally while rank 1 still needs the others: rank 0
    lingers until rank 1 has read that it left, and rank 1, whose store then closes, ends normally."""
    ends = run_ranks("store_host_worker.py", store="rank0", timeout=120)
    assert [end.returncode for end in ends] == [0, 0] and "Elixir:" not in ends[1].stderr, ends[1].stderr[-3000:]


def test_every_rank_of_three_exits_alike_when_one_stops(tmp_path) -> None:
    """Rank 1 of 3 stopped inside a step: ranks 0 and 2 both end with exit status 69 and the verdict
    naming rank 1, whichever judged first and whichever collective the other was in."""
    ends = run_ranks("stall_worker.py", str(tmp_path), "stop", "step", "1", ranks=3, timeout=300)
    for rank in (0, 2):
        assert "(rank 1 (pid " in _verdict(ends[rank], rank)
    assert ends[1].returncode == -9
    _timed("stop rank 1 of 3", False, float((tmp_path / "fault").read_text()), ends, 3)


def test_a_rank_stopped_between_steps_is_named_in_an_accelerate_loops_gather(tmp_path) -> None:
    """An Accelerate loop's own collective after the engine's step (``accelerator.gather(loss)``) is
    under the lockstep timeout: rank 0, waiting there for rank 1 stopped after its ``zero_grad``, ends
    naming it. Before: nothing until the process group's timeout (30 minutes)."""
    ends = run_ranks("accelerate_stall_worker.py", str(tmp_path), timeout=300)
    verdict = _verdict(ends[0], 0)
    assert re.search(r"\(rank 1 \(pid \d+ on [^)]+\) for \d+\.\d s; ElixirConfig.lockstep_timeout_s=2\)", verdict)
    assert ends[1].returncode == -9  # stopped, and killed once rank 0 had ended
    _timed("stop rank 1 between steps, Accelerate gather", False, float((tmp_path / "fault").read_text()), ends, 2)
