"""``EngineContext``: what the parts of one engine share, built once by ``prepare``.

The job's collectives, the compute device and dtype, the ranks' check-ins, the counters and the
loop's phase: ``ChunkRuntime`` and the parts it holds (``ChunkGathers``, ``ChunkGradients``,
``HostUpdates``) take this one object rather than each of these as a parameter of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adam_state import AdamState
from ..distributed.collectives import Collectives
from ..distributed.lockstep import Lockstep
from .oom import PlannedMemory
from .phase import EnginePhase
from .stats import StatsCounter

__all__ = ["EngineContext"]


@dataclass(frozen=True, eq=False)
class EngineContext:
    coll: Collectives
    """The job's process group (one rank: every collective a no-op)."""
    device: torch.device
    """The compute device: the rCache, the device's arenas, the device lane."""
    dtype: torch.dtype
    """The compute dtype: gathered parameters and gradients (masters are fp32)."""
    lockstep: Lockstep
    """The ranks' check-in before each forward, ``state_dict()`` and ``full_params``."""
    state: AdamState
    """The optimizer state of each trainable element (the plan's ``moments``)."""
    stats: StatsCounter = field(default_factory=StatsCounter)
    phase: EnginePhase = field(default_factory=EnginePhase)
    memory: PlannedMemory | None = None
    """What the plan predicted of the GPU, which an out-of-memory error is told against (``oom.py``)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
