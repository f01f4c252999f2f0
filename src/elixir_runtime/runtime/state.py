"""Chunk states: where a chunk's parameters are, and where its gradient is in the step.

Each chunk carries two state machines that change independently ([Note: two machines]):

* ``ParamState``: whether its parameters are readable, and from where (``gathers.py``);
* ``GradState``: what its gradient shard and its gathered buffer hold of this step's gradient
  (``gradients.py``).

Each has one table of legal transitions (``PARAM_TRANSITIONS``, ``GRAD_TRANSITIONS``), and every
change of either goes through ``ChunkState.transition``. With checking on (``ELIXIR_DEBUG_STATES=1``
in the environment when this module is imported, or ``check_transitions(True)``) it raises
``IllegalTransition`` naming the chunk and both states for any change the table does not list, and
checks the two rules that tie the machines together (see ``_check``). Off, a transition is an
attribute write behind one global flag test.

[Note: two machines] A chunk's parameters can be gathered while its gradient is in any state (a
chunk is re-gathered in backward after an earlier micro-step's reduction), and a chunk can be
released while its gradient shard holds gradients: the states are a product, not a list. The two
meet at the gathered buffer only: in backward the buffer holds gradients in the slots of the
parameters whose gradient arrived (``written``), so while ``GradState`` is ``WRITING`` or
``ACCUMULATING`` the parameters must stay ``GATHERED`` until the reduction frees the buffer.

[Note: pins] A pin (``ChunkState.pins``, a count: chunks shared by units are pinned by each) holds
a chunk against eviction while a unit runs; it is not a state. A reduction frees a chunk's buffer
even while the unit that produced its last gradient still pins it: a later saved-tensor unpack of
that unit gathers the chunk again.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import torch

from ..chunk.layout import ChunkSpec
from ..chunk.rcache import Buffer
from ..chunk.store import ShardArenas

__all__ = [
    "GRAD_TRANSITIONS",
    "PARAM_TRANSITIONS",
    "ChunkState",
    "GradState",
    "IllegalTransition",
    "ParamState",
    "check_transitions",
]


class ParamState(enum.Enum):
    """Where a chunk's parameters can be read."""

    RELEASED = "released"
    """Only as shards: each parameter's ``.data`` is a zero-stride placeholder. A private chunk keeps
    its buffer, holding stale values."""
    GATHERING = "gathering"
    """An all-gather into its buffer is issued on the fetch stream (a prefetch, or an acquire that
    has not reached it yet); the compute stream has not waited for it (``ready``)."""
    GATHERED = "gathered"
    """Its buffer holds the gathered parameters and the compute stream has waited for them."""
    COPIED = "copied"
    """Inside ``full_params``: gathered into a buffer of its own, outside the rCache; hooks stand by."""


class GradState(enum.Enum):
    """What a trainable chunk holds of the gradients since ``zero_grad`` (frozen chunks stay ``EMPTY``)."""

    EMPTY = "empty"
    """No gradient since ``zero_grad``: the shard is stale (or freed, on the device); the next
    reduction overwrites it."""
    WRITING = "writing"
    """This backward's gradients of some parameters (``written``) are in the gathered buffer; the
    shard holds none: the reduction overwrites it."""
    ACCUMULATING = "accumulating"
    """As ``WRITING``, over a shard that holds earlier micro-steps' gradients: the reduction adds."""
    REDUCED = "reduced"
    """Reduced in this backward: the buffer is freed; another gradient for it in this backward is an error."""
    HELD = "held"
    """The shard holds the gradients of the backwards since ``zero_grad``; the next reduction adds."""


PARAM_TRANSITIONS: dict[ParamState, frozenset[ParamState]] = {
    ParamState.RELEASED: frozenset({ParamState.GATHERING, ParamState.COPIED}),  # gather / full_params
    ParamState.GATHERING: frozenset({ParamState.GATHERED, ParamState.RELEASED}),  # first use / evicted unused
    ParamState.GATHERED: frozenset({ParamState.RELEASED}),  # evicted, reduced, stale after a step or a load
    ParamState.COPIED: frozenset({ParamState.RELEASED}),  # full_params exits
}
"""The legal changes of ``ParamState``: from each state, the states it may go to."""

GRAD_TRANSITIONS: dict[GradState, frozenset[GradState]] = {
    GradState.EMPTY: frozenset(
        {
            GradState.WRITING,  # a parameter's gradient arrives
            GradState.REDUCED,  # end of backward, several ranks: reduced with zeros from this rank
            GradState.HELD,  # end of backward, one rank: no gradient, the shard is zeroed
        }
    ),
    GradState.WRITING: frozenset({GradState.REDUCED}),  # the last gradient arrives, or end of backward
    GradState.ACCUMULATING: frozenset({GradState.REDUCED}),
    GradState.REDUCED: frozenset({GradState.HELD}),  # end of backward
    GradState.HELD: frozenset(
        {
            GradState.ACCUMULATING,  # the next micro-step's first gradient
            GradState.REDUCED,  # end of the next backward, several ranks: zeros added
            GradState.EMPTY,  # zero_grad
        }
    ),
}
"""The legal changes of ``GradState``: from each state, the states it may go to."""

_GRAD_IN_BUFFER = (GradState.WRITING, GradState.ACCUMULATING)
_HAS_GRAD = (GradState.ACCUMULATING, GradState.REDUCED, GradState.HELD)

CHECKING = os.environ.get("ELIXIR_DEBUG_STATES", "") not in ("", "0")
"""Whether ``ChunkState.transition`` checks the tables (read at every transition)."""


def check_transitions(on: bool) -> bool:
    """Turns the transition checks on or off in this process; returns the previous setting.
    (Worker processes inherit ``ELIXIR_DEBUG_STATES`` from the environment instead.)"""
    global CHECKING
    old, CHECKING = CHECKING, bool(on)
    return old


class IllegalTransition(RuntimeError):
    """A chunk state change that its table does not list (raised only with checking on)."""


@dataclass(eq=False)
class ChunkState:
    spec: ChunkSpec
    shards: ShardArenas
    """The arenas (device or host) holding this chunk's shard and optimizer states, at ``offset``."""
    offset: int
    shard_numel: int
    name: str = ""
    """Its first parameter's name, for messages."""
    buffer: Buffer | None = None
    """The rCache buffer of the gathered chunk, while it has one (a private chunk: always)."""
    param_state: ParamState = ParamState.RELEASED
    grad_state: GradState = GradState.EMPTY
    pins: int = 0
    """Units holding it against eviction ([Note: pins])."""
    written: set[int] = field(default_factory=set)
    """Params whose gradient is in the buffer in the current backward (``WRITING``/``ACCUMULATING``)."""
    ready: torch.cuda.Event | None = None
    """Gather finished (CUDA, while ``GATHERING``); consumed by the first use on the compute stream."""
    gathered: torch.cuda.Event | None = None
    """Last gather finished: the host shard may be rewritten after it."""
    reduced_event: torch.cuda.Event | None = None
    """Last reduction (and D2H copy) finished: the grad shard may be read after it."""
    n_grad_params: int = 0
    grad: torch.Tensor | None = None
    """This rank's reduced gradient shard: a view of the host arena for an offloaded chunk; on the
    device a tensor of its own from the chunk's first reduction of a step to ``zero_grad``."""

    def transition(self, new: ParamState | GradState) -> None:
        """The one way a chunk changes state; checks the table when checking is on."""
        if isinstance(new, ParamState):
            if CHECKING:
                _check(self, self.param_state, new)
            self.param_state = new
        else:
            if CHECKING:
                _check(self, self.grad_state, new)
            self.grad_state = new

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def valid(self) -> bool:
        """Its buffer holds (or is being filled with) the gathered params."""
        return self.param_state is ParamState.GATHERED or self.param_state is ParamState.GATHERING

    @property
    def has_grad(self) -> bool:
        """Its shard holds gradients since ``zero_grad`` (the next reduction adds to them)."""
        return self.grad_state in _HAS_GRAD

    @property
    def gather_source(self) -> torch.Tensor:
        """This rank's shard as gathers read it (the fp32 master where no compute-dtype copy is kept)."""
        return self.shards.source(self.offset, self.shard_numel, self.spec.trainable)

    def grad_shard(self) -> torch.Tensor:
        """The gradient shard, allocated (uninitialised) on the current stream if it has none."""
        if self.grad is None:
            self.grad = torch.empty(self.shard_numel, dtype=self.shards.param.dtype, device=self.shards.device)
        return self.grad

    @property
    def evictable(self) -> bool:
        return not self.spec.private and self.pins == 0 and not self.written

    def __repr__(self) -> str:
        return f"chunk {self.index} ({self.name!r}, {self.param_state.name}, {self.grad_state.name}, pins={self.pins})"


def _check(c: ChunkState, old: ParamState | GradState, new: ParamState | GradState) -> None:
    """Raises ``IllegalTransition`` unless ``old -> new`` is in its table and keeps the rules tying
    the machines together: gradients are written only into a gathered buffer, and a buffer holding
    gradients not yet reduced is never released ([Note: two machines])."""
    allowed: frozenset[ParamState] | frozenset[GradState] = (
        PARAM_TRANSITIONS[old] if isinstance(old, ParamState) else GRAD_TRANSITIONS[old]
    )
    kind = type(new).__name__
    where = f"chunk {c.index} (first param {c.name!r})"
    if new not in allowed:
        legal = ", ".join(sorted(s.name for s in allowed)) or "nothing"
        raise IllegalTransition(
            f"{where}: illegal {kind} transition {old.name} -> {new.name} (from {old.name}: {legal})"
        )
    if new in _GRAD_IN_BUFFER and c.param_state is not ParamState.GATHERED:
        raise IllegalTransition(
            f"{where}: {kind} {old.name} -> {new.name} while its params are {c.param_state.name}, not GATHERED"
        )
    if new is ParamState.RELEASED and c.grad_state in _GRAD_IN_BUFFER:
        raise IllegalTransition(
            f"{where}: {kind} {old.name} -> {new.name} while its gradients are {c.grad_state.name} in the buffer"
        )
