"""How many threads the CPU Adam of offloaded chunks gets.

Not ``torch.get_num_threads()``: ``torchrun`` sets ``OMP_NUM_THREADS=1`` for every rank, which
would leave the update of tens of GB of optimizer state to one core. Each rank takes its share of
the cores this process may run on, less one kept for the rank's own Python thread, which issues
every kernel of the forward and backward the update overlaps (the update is bound by memory
bandwidth: docs/kernels.md, "Engine threads").
"""

from __future__ import annotations

import os

__all__ = ["usable_cores", "cpu_adam_threads"]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under ``taskset`` or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_adam_threads(ranks_per_host: int, requested: int | None = None, cores: int | None = None) -> int:
    """``requested`` if given, else ``cores`` (default ``usable_cores()``) // ``ranks_per_host``
    less one kept for the training loop when that share has more than two cores."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {requested}")
        return requested
    share = max(1, (cores or usable_cores()) // max(1, ranks_per_host))
    return share - 1 if share > 2 else share
