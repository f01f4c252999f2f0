"""A rank of the 2-rank job in ``test_hardware_profile``, in a module of its own: the spawned ranks
import only torch and the engine (not transformers, as the test module's helpers do)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from elixir_runtime.chunk.collectives import Collectives
from elixir_runtime.hardware import measure
from elixir_runtime.hardware.load import ENV_HARDWARE, job_hardware


def job_measures_cpu_adam(rank: int, world: int, cache: str) -> tuple:
    """Both ranks of a 2-rank host: the first job measures (windows recorded), the second reuses."""
    os.environ.update(ELIXIR_CACHE_DIR=cache, LOCAL_WORLD_SIZE=str(world))
    os.environ.pop(ENV_HARDWARE, None)
    windows = []
    timed = measure._window

    def recorded(step, seconds):
        start = time.time()
        per_call = timed(step, seconds)
        if seconds > 0:
            windows.append((start, time.time()))
        return per_call

    measure._window = recorded
    coll = Collectives(dist.group.WORLD)
    first = job_hardware(coll, torch.device("cpu"), quick=True)
    measured = len(windows)
    second = job_hardware(coll, torch.device("cpu"), quick=True)
    return first.cpu_adam, second.cpu_adam, windows, measured, len(windows)


def job_records_update_rate(rank: int, world: int, cache: str) -> float:
    """Both ranks of a 2-rank host report their own update rate; the slowest is recorded."""
    from elixir_runtime.hardware.load import record_update_rate

    os.environ.update(ELIXIR_CACHE_DIR=cache, LOCAL_WORLD_SIZE=str(world))
    os.environ.pop(ENV_HARDWARE, None)
    return record_update_rate(Collectives(dist.group.WORLD), torch.device("cpu"), 2, 7, 1e9 * (rank + 2))
