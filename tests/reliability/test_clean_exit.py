"""2-rank jobs end with exit code 0: a real ``torchrun`` job, looped, never prints ``terminate
called`` (SIGABRT at interpreter exit when gloo's worker thread frees Python-made tensors, see
``Collectives._run``). A short loop by default; ``ELIXIR_LONG_TESTS=1`` runs 50 (100 of the bare
collectives), as was done once before merging."""

from __future__ import annotations

import os
import subprocess

from launch import run_script

LONG = os.environ.get("ELIXIR_LONG_TESTS") == "1"


def _check(runs: list[subprocess.CompletedProcess]) -> None:
    bad = [(i, r) for i, r in enumerate(runs) if r.returncode != 0 or "terminate called" in r.stderr]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit cleanly; first:\n{bad[0][1].stderr[-3000:]}"


def test_engine_collectives_exit_cleanly() -> None:
    _check([run_script("collectives_worker.py", ranks=2) for _ in range(100 if LONG else 4)])


def test_trainer_job_exits_cleanly(tmp_path) -> None:
    _check([run_script("exit_worker.py", str(tmp_path / str(i)), ranks=2) for i in range(50 if LONG else 1)])
