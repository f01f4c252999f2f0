"""How many threads the CPU Adam of offloaded chunks gets.

Each rank takes its share of the cores (``host.core_share``: not torchrun's ``OMP_NUM_THREADS=1``,
which would leave the update of tens of GB of optimizer state to one core), less one kept for the
rank's own Python thread, which issues every kernel of the forward and backward the update
overlaps (the update is bound by its memory accesses: docs/kernels.md, "Engine threads").
"""

from __future__ import annotations

from ..host import core_share

__all__ = ["cpu_adam_threads"]


def cpu_adam_threads(ranks_per_host: int, requested: int | None = None, cores: int | None = None) -> int:
    """``requested`` if given, else the rank's ``core_share`` less one kept for the training loop
    when that share has more than two cores."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {requested}")
        return requested
    share = core_share(ranks_per_host, cores)
    return share - 1 if share > 2 else share
