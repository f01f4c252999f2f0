"""Launch mistakes caught before the engine is built: one message per job, naming the fix.

Two checks, both run by ``ElixirTrainingArguments`` and ``ElixirAccelerator`` when Elixir is on:

- ``check_devices``, before Accelerate builds its state (the earliest point: transformers would
  fail on ``--bf16`` without a GPU, Accelerate on a GPU index the host does not have): a job of N
  processes that sees no GPU and was not told to run on the CPU (``accelerate launch`` of N CPU
  processes without ``--use_cpu``/``cpu=True``, or a GPU job whose ranks see no GPU); a rank whose
  ``LOCAL_RANK`` has no GPU of its own.
- ``check_launch``, after it: the launched world size against the one the Trainer or Accelerator
  counts (the engine shards over every launched process, the data is split over the counted ones).

A failure is a ``LaunchError``, a ``SystemExit`` carrying the message: the process ends with it on
stderr and status 1, without a traceback per rank. A mistake every rank makes is said by rank 0
alone; the others wait (``QUIET_RANK_WAIT_S``) for the launcher, which stops every rank when one
fails, so rank 0's message is not cut off by another rank's exit.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["LaunchError", "check_devices", "check_launch", "stop", "QUIET_RANK_WAIT_S"]

QUIET_RANK_WAIT_S = 30.0
"""How long a rank other than 0 waits before it exits without a word, when rank 0 reports the
mistake they share: launchers (torchrun, accelerate launch) stop it as soon as rank 0 exits."""


class LaunchError(SystemExit):
    """The job was launched in a way the engine cannot run; its message says the fix. A
    ``SystemExit``: uncaught, Python prints the message alone and exits with status 1."""


def check_devices(who: str, cpu: bool) -> None:
    """Before Accelerate's state is built. ``who``: ``"Trainer"`` or ``"Accelerator"``; ``cpu``: the
    script asked for the CPU (``--use_cpu``, ``cpu=True``; ``ACCELERATE_USE_CPU`` counts too)."""
    if cpu or _env_flag("ACCELERATE_USE_CPU"):
        return
    launched = _launched()
    if launched > 1 and not torch.cuda.is_available():
        stop(_no_gpu_message(launched, who), every_rank_says_it=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if local_rank >= 0 and torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        local = os.environ.get("LOCAL_WORLD_SIZE", "?")
        stop(
            f"elixir-hf: rank {_rank()} (local rank {local_rank}) has no GPU of its own: this host shows {gpus} "
            f"GPU(s) ({_visible()}) to {local} processes. Launch at most {gpus} process(es) per host "
            f"(accelerate launch --num_processes {gpus}, torchrun --nproc_per_node {gpus}), or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES).",
            every_rank_says_it=False,
        )


def check_launch(world_size: int, who: str = "Trainer/Accelerator") -> None:
    """After Accelerate's state is built: the engine shards over every launched process and the
    Trainer or Accelerator (``world_size`` ranks) must split the data over as many."""
    launched = _launched()
    if launched == world_size:
        return
    if launched > 1 and world_size == 1 and not torch.cuda.is_available():
        message = _no_gpu_message(launched, who)
    else:
        message = (
            f"elixir-hf: {launched} processes were launched but the {who} counts {world_size}: the Elixir engine "
            f"would shard over ranks the data is not split over. Launch one process per GPU (accelerate launch "
            f"--num_processes N, torchrun --nproc_per_node N) and let the {who} see them all."
        )
    stop(message, every_rank_says_it=True)


def _no_gpu_message(launched: int, who: str) -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    in_code = "--use_cpu in its arguments" if who == "Trainer" else "ElixirAccelerator(cpu=True) in the script"
    return (
        f"elixir-hf: {launched} processes were launched, but they see no GPU ({_visible()}) and the {who} was not "
        f"told to run on the CPU: each process would train alone.\n"
        f"  a CPU job: launch it with ACCELERATE_USE_CPU=1, e.g.\n"
        f"      ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {launched} {script} ...\n"
        f"    (or ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {launched} ...), or {in_code}. "
        f"`accelerate launch --cpu` starts a single process.\n"
        f"  a GPU job: check CUDA_VISIBLE_DEVICES and that nvidia-smi lists this host's GPUs."
    )


def _visible() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return f"CUDA_VISIBLE_DEVICES={value!r}"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    return "torch finds no CUDA device"


def _launched() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def stop(message: str, every_rank_says_it: bool) -> None:
    """Ends this process with ``message`` (a ``LaunchError``); a mistake every rank makes is said by rank 0 alone."""
    if every_rank_says_it and _rank() != 0:
        time.sleep(QUIET_RANK_WAIT_S)  # rank 0 says it; the launcher stops this rank when rank 0 exits
        raise LaunchError(1)
    raise LaunchError(message)
