"""Runs a worker script of this folder in a fresh process, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LONG = os.environ.get("ELIXIR_LONG_TESTS") == "1"
"""The long fault-injection loops (run once before merging); CI runs short ones."""


def run_script(script: str, *args: str, ranks: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script args`` next to this file, on the CPU; under ``torchrun`` with ``ranks``."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks else []
    return run_python(*launch, str(Path(__file__).with_name(script)), *args, timeout=timeout)


def run_python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python args`` on the CPU, with this process's import path and without ``ELIXIR_CONFIG``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ELIXIR_CONFIG", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def assert_clean_exits(runs: list[subprocess.CompletedProcess]) -> None:
    """Every run ended with exit code 0 and without gloo's ``terminate called`` abort."""
    bad = [(i, r) for i, r in enumerate(runs) if r.returncode != 0 or "terminate called" in r.stderr]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit cleanly; first:\n{bad[0][1].stderr[-3000:]}"
