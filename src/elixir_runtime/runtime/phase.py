"""The engine's phase of the training loop, and the one place it changes (FSDP2's ``TrainingState``).

The module hooks (``hooks.py``: a forward), the gradients (``gradients.py``: a backward) and
``full_params`` (``full_params.py``) each move it through ``EnginePhase.to``; whoever needs to
know where the loop is reads ``EnginePhase.now``. Like the chunk states (``state.py``), a change
the table does not list raises ``IllegalTransition`` when checking is on (``ELIXIR_DEBUG_STATES=1``).

Whether a backward is owed (a grad-enabled forward ran and its backward has not finished:
``ChunkGradients.backward_pending``) is gradient bookkeeping beside the phase, not a phase: a
second forward may run before it (accumulating two losses), and a forward that needed no grad
owes none.
"""

from __future__ import annotations

import enum

from . import state
from .state import IllegalTransition

__all__ = ["PHASE_TRANSITIONS", "EnginePhase", "Phase"]


class Phase(enum.Enum):
    IDLE = "idle"
    """Between forwards and backwards: steps, checkpoints and ``full_params`` happen here."""
    FORWARD = "forward"
    """Inside the model's forward (the root's pre-forward to its post-forward)."""
    BACKWARD = "backward"
    """From a backward's first gradient hook to its end (``ChunkGradients.finish_backward``)."""
    FULL = "full"
    """Inside ``full_params``: every parameter on this rank; forwards run alone, the hooks stand by."""
    FULL_ELSEWHERE = "full on rank 0 only"
    """Inside ``full_params(rank0_only=True)`` on another rank: no forward can run here."""


PHASE_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.FULL, Phase.FULL_ELSEWHERE}),
    Phase.FORWARD: frozenset({Phase.IDLE}),
    # a backward that raised never reaches its end: the next forward starts from there
    Phase.BACKWARD: frozenset({Phase.IDLE, Phase.FORWARD}),
    Phase.FULL: frozenset({Phase.IDLE}),
    Phase.FULL_ELSEWHERE: frozenset({Phase.IDLE}),
}
"""The legal changes of ``Phase``: from each phase, the phases it may go to."""


class EnginePhase:
    def __init__(self) -> None:
        self.now = Phase.IDLE

    def to(self, new: Phase) -> None:
        """The one way the phase changes; checks the table when checking is on."""
        if state.CHECKING and new not in PHASE_TRANSITIONS[self.now]:
            legal = ", ".join(sorted(p.name for p in PHASE_TRANSITIONS[self.now]))
            raise IllegalTransition(f"engine phase {self.now.name} -> {new.name} (from {self.now.name}: {legal})")
        self.now = new

    @property
    def full(self) -> bool:
        """Inside ``full_params`` (on any rank): the module hooks stand by."""
        return self.now is Phase.FULL or self.now is Phase.FULL_ELSEWHERE
