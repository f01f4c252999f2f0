"""Runs a worker script of this folder in a fresh process, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(script: str, *args: str, ranks: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script args`` next to this file, on the CPU; under ``torchrun`` with ``ranks``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("ELIXIR_CONFIG", None)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks else []
    cmd = [sys.executable, *launch, str(Path(__file__).with_name(script)), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
