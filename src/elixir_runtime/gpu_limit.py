"""The GPU memory this process may use: ``ElixirConfig.gpu_memory`` and torch's per-process fraction.

One limit, held by torch's caching allocator: ``limit_gpu_memory`` lowers the process's memory
fraction (``torch.cuda.set_per_process_memory_fraction``) to ``gpu_memory / total`` unless the user
set a smaller one, and the planner reads the limit back from the allocator (``process_limit``), so
the plan and the enforcement cannot disagree: the budget's capacity is
``min(free + cached, total x fraction - allocated)``. The limit counts what the allocator holds
(every tensor, the allocator's cache included), not the CUDA context nor NCCL's buffers; planning
a larger card as a smaller one: docs/planning.md, "The GPU-memory cap".
"""

from __future__ import annotations

import logging
import os

import torch

from .config import ConfigError

__all__ = ["device_capacity", "expandable_segments", "limit_gpu_memory", "process_limit"]

logger = logging.getLogger(__name__)

GIB = 2**30


def limit_gpu_memory(device: torch.device, gpu_memory: int | None) -> None:
    """Makes the caching allocator of ``device`` refuse to hold more than ``gpu_memory`` bytes
    (unless the fraction the user set is smaller); a cap above the card's memory is an error."""
    if gpu_memory is None:
        return
    total = torch.cuda.mem_get_info(device)[1]
    if gpu_memory > total:
        raise ConfigError(
            f"ElixirConfig.gpu_memory is {gpu_memory / GIB:.2f} GiB ({gpu_memory} bytes), more than the "
            f"{total / GIB:.2f} GiB of {device} ({torch.cuda.get_device_name(device)}): use at most {total} bytes, "
            "or None for the whole GPU"
        )
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if gpu_memory < fraction * total:
        torch.cuda.set_per_process_memory_fraction(gpu_memory / total, device)
        logger.info(
            "elixir: %s limited to %.2f GiB (ElixirConfig.gpu_memory): memory fraction %.4f",
            device,
            gpu_memory / GIB,
            gpu_memory / total,
        )
    else:
        logger.info(
            "elixir: ElixirConfig.gpu_memory %.2f GiB: the memory fraction %.4f already set on %s allows "
            "no more (%.2f GiB) and stays",
            gpu_memory / GIB,
            fraction,
            device,
            fraction * total / GIB,
        )


def process_limit(device: torch.device) -> int | None:
    """Bytes the caching allocator of ``device`` may hold (total x the process's memory fraction);
    ``None`` without a limit (fraction 1)."""
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return None if fraction >= 1 else int(fraction * torch.cuda.mem_get_info(device)[1])


def device_capacity(device: torch.device) -> int:
    """GPU bytes a plan may still take on ``device``: what is free plus what torch's allocator holds
    unused, within the process's limit (less what is allocated now)."""
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    capacity = free + torch.cuda.memory_reserved(device) - allocated
    limit = process_limit(device)
    return capacity if limit is None else max(0, min(capacity, limit - allocated))


_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments() -> bool:
    """Turns on the caching allocator's expandable segments unless the user's allocator settings
    (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``) choose; returns whether they are on.

    The on-device chunks' gradient shards are allocated during backward, among the recomputed
    activations, and freed after the update (``chunk/store.py``); in fixed-size segments that
    interleaving fragments the cache (docs/runtime.md, "Semantics worth knowing"). Expandable segments
    map pages into one growing range per stream, so freed memory is whole again; without them the
    planner counts every gradient beside the activations.
    """
    conf = ",".join(os.environ.get(k, "") for k in _ALLOC_CONF).replace(" ", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key == "expandable_segments":
            return value.lower() == "true"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter("expandable_segments:True")
        else:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (RuntimeError, AttributeError) as err:  # a build without them (e.g. not Linux)
        logger.info("elixir: expandable segments unavailable (%s): gradients are planned beside the activations", err)
        return False
    logger.info(
        "elixir: turned on the CUDA caching allocator's expandable segments (set PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:False to keep fixed segments; the plan then counts gradients beside activations)"
    )
    return True
