"""Self-tests for the gloo harness (helpers/dist.py); test_tiny_models.py tests the tiny models."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.dist import DistributedError, run_distributed

# --- rank functions (module level so spawn can pickle them) -----------------


def _rank_sum(rank: int, world_size: int, scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item() * scale


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_in_collective(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one died before the collective")
    dist.barrier()  # rank 0 blocks here forever; the harness must not
    return rank


def _fail_with_a_teardown_that_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        # as NCCL's teardown flushing a collective rank 0 never joins, not knowing rank 1 failed
        dist.destroy_process_group = lambda *_: time.sleep(3600)
        raise RuntimeError("rank one failed in a forward")
    return rank


def _crash_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no Python exception, no report: like a segfault
    return rank


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _environment(rank: int, world_size: int) -> tuple[str | None, str | None]:
    return os.environ.get("ELIXIR_HARNESS_PROBE"), os.environ.get("OMP_NUM_THREADS")


# --- harness ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_per_rank_values(world_size: int) -> None:
    out = run_distributed(_rank_sum, world_size, 10, timeout=120)
    expected_sum = sum(range(world_size)) * 10
    assert out == [(r, world_size, float(expected_sum)) for r in range(world_size)]


def test_exception_in_one_rank_is_reported() -> None:
    with pytest.raises(DistributedError, match="boom from rank one") as excinfo:
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert "rank 1" in str(excinfo.value)
    assert "ValueError" in str(excinfo.value)


def test_failed_rank_does_not_hang_peers() -> None:
    with pytest.raises(DistributedError, match="rank one died"):
        run_distributed(_hang_in_collective, 2, timeout=60)


def test_an_error_is_reported_before_the_teardown() -> None:
    """Else it comes only once the group is torn down, which under NCCL can wait for ever."""
    with pytest.raises(DistributedError, match="rank one failed in a forward"):
        run_distributed(_fail_with_a_teardown_that_hangs, 2, timeout=30)


def test_silent_crash_is_reported() -> None:
    with pytest.raises(DistributedError, match="exited with code 3"):
        run_distributed(_crash_rank_one, 2, timeout=60)


def test_timeout_kills_children() -> None:
    with pytest.raises(DistributedError, match="timed out"):
        run_distributed(_sleep_forever, 2, timeout=1)  # times out whether or not the ranks have started


def test_ranks_see_the_environment_at_start(monkeypatch) -> None:
    """Ranks fork from a forkserver started earlier: they must still see the variables the test set."""
    run_distributed(_rank_sum, 2, 1, timeout=120)  # the forkserver runs before the variable exists
    monkeypatch.setenv("ELIXIR_HARNESS_PROBE", "set-by-the-test")
    assert run_distributed(_environment, 2, timeout=120) == [("set-by-the-test", "1")] * 2
    monkeypatch.delenv("ELIXIR_HARNESS_PROBE")
    assert run_distributed(_environment, 2, timeout=120) == [(None, "1")] * 2


def _visible_gpus(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


def test_the_suite_sees_no_gpu_unless_it_runs_on_cuda() -> None:
    """``make test`` on a GPU machine runs as on a CPU-only one (tests/conftest.py): the test process,
    the ranks of ``helpers.dist`` and the processes the tests launch see no GPU; ``prepare`` without a
    device computes on the CPU."""
    from helpers.device import ON_CUDA

    if ON_CUDA:
        pytest.skip("ELIXIR_TEST_DEVICE=cuda: the suite computes on the GPUs by design")
    assert _visible_gpus(0, 1) == ("", 0)
    assert run_distributed(_visible_gpus, 2, timeout=120) == [("", 0)] * 2
    launched = subprocess.run(
        [sys.executable, "-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.device_count())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert launched.stdout.split() == ["''", "0"]


def test_on_cuda_the_cpu_tests_skip_saying_so() -> None:
    """With ``ELIXIR_TEST_DEVICE=cuda`` (``make test-gpu``) the engine's suites (``cuda_suite``) and the
    ``gpu`` tests compute on CUDA; a test that computes on the CPU by design skips, naming ``make test``,
    rather than failing on a batch made on the GPU (tests/conftest.py)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", "tests/elixir_runtime/test_progress.py"],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], env={**os.environ, "ELIXIR_TEST_DEVICE": "cuda"},
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and "skipped" in summary and "passed" not in summary, run.stdout[-2000:]
    assert "computes on the CPU by design: `make test` runs it" in run.stdout


# --- no process outlives the one that started it (helpers/lifetime.py) ----------------------

_REAPER = """
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the orphaned grandchild becomes ours to wait on
parent = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
child = int(parent.stdout.readline())
os.kill(parent.pid, signal.SIGKILL)
parent.wait()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1)
        break
    time.sleep(0.01)  # a bounded poll of the pid, not a wait for something to happen in time
else:
    os.kill(child, signal.SIGKILL)
    print("alive")
"""

_PARENT = """
import signal, subprocess, sys
from helpers.lifetime import die_with_parent
# Popen returns once the child has exec'd, so its preexec_fn (the prctl) has run: the pid is printed after it
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
signal.pause()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_child_dies_with_its_parent() -> None:
    """A process that called ``die_with_parent`` is killed when its parent is (SIGKILL: no handler of the
    parent's runs): what keeps a rank or a worker from outliving an interrupted ``make test``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _REAPER, _PARENT], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(int(signal.SIGKILL)), out.stdout + out.stderr


def _death_signal(rank: int, world_size: int) -> int:
    from helpers.lifetime import parent_death_signal

    return parent_death_signal()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_ranks_die_with_their_parent() -> None:
    """Each rank ``helpers.dist`` forks dies with the forkserver (which exits with the test process)."""
    assert run_distributed(_death_signal, 2, timeout=120) == [signal.SIGKILL] * 2
