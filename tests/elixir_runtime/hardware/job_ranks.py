"""A rank of the 2-rank job in ``test_hardware_profile``, in a module of its own: the spawned ranks
import only torch and the engine (not transformers, as the test module's helpers do)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from elixir_runtime.adam_state import ADAM_STATE
from elixir_runtime.distributed.collectives import Collectives
from elixir_runtime.hardware import measure
from elixir_runtime.hardware.load import ENV_HARDWARE, job_hardware

FP32 = ADAM_STATE["fp32"]


def job_measures_cpu_adam(rank: int, world: int, cache: str) -> tuple:
    """Both ranks of a 2-rank host: the first job measures, the second reuses. Recorded in order: each
    collective the job issues and each timed window of the kernel (``"window"``; the untimed first
    use is not one)."""
    os.environ.update(ELIXIR_CACHE_DIR=cache, LOCAL_WORLD_SIZE=str(world))
    os.environ.pop(ENV_HARDWARE, None)
    events: list[str] = []
    timed = measure._window

    def recorded(step, seconds):
        if seconds > 0:
            events.append("window")
        return timed(step, seconds)

    measure._window = recorded
    coll = Collectives(dist.group.WORLD)
    reduce = coll.all_reduce_sum_
    coll.all_reduce_sum_ = lambda t: (events.append("all_reduce"), reduce(t))[1]
    first = job_hardware(coll, torch.device("cpu"), quick=True)
    measured = events.count("window")
    second = job_hardware(coll, torch.device("cpu"), quick=True)
    return first.cpu_adam, second.cpu_adam, events, measured, events.count("window")


def job_records_update_rate(rank: int, world: int, cache: str) -> float:
    """Both ranks of a 2-rank host report their own update rate; the slowest is recorded."""
    from elixir_runtime.hardware.load import record_update_rate

    os.environ.update(ELIXIR_CACHE_DIR=cache, LOCAL_WORLD_SIZE=str(world))
    os.environ.pop(ENV_HARDWARE, None)
    return record_update_rate(Collectives(dist.group.WORLD), torch.device("cpu"), 2, 7, 1e9 * (rank + 2), FP32)
