"""Bytes per rank of a placement, counted exactly as the engine allocates them (``chunk/store.py``).

Per chunk shard: the compute-dtype parameter (none for a trainable shard on the GPU in mixed
precision: gathers cast the master), and for trainable chunks the compute-dtype gradient, the
moments and an fp32 master (aliased to the parameter in fp32 runs): ``adam_state.py``. The rCache is ``n_blocks``
buffers of the largest public chunk; each private chunk has a buffer of its own size. Host arenas
are pinned at their exact size. With the device lane the GPU also holds its staging
(``LANE_DEPTH`` slices) while a trainable chunk is offloaded.

[Note: gradient window] GPU-resident gradient shards exist from their first reduction to
``zero_grad``. Each backward segment is a ``WindowStep``: the shards existing by its end may take
the activation bytes freed by its peak, credited at ``F_ALLOC / F_FRAG`` (freed bytes are as
fragmented as the activations were); the plan counts the most any step holds beyond its slack.
No window with gradient accumulation (the shards outlive the next forwards). Measured:
docs/planning.md, "Memory of a plan"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..adam_state import AdamState
from ..chunk.layout import ChunkLayout
from ..chunk.store import Where, casts_on_gather, grads_on_demand
from ..profiler.profile import BackwardSegment
from ..runtime.device_lane import LANE_DEPTH, lane_numel

__all__ = [
    "ArenaBytes",
    "GradWindow",
    "WindowStep",
    "grad_window",
    "trainable_bytes",
    "staging_bytes",
]


def staging_bytes(numel: int, dtype: torch.dtype, state: AdamState) -> int:
    """GPU bytes of the lane's staging buffers for slices of ``numel`` elements: the optimizer state
    (master and moments) and one compute-dtype tensor (the gradient, then the new param) per buffer."""
    return LANE_DEPTH * (state.nbytes(numel) + numel * torch.empty((), dtype=dtype).element_size())


def trainable_bytes(numel: int, dtype: torch.dtype, placement: Where, state: AdamState) -> int:
    """Bytes of a trainable shard of ``numel`` elements in ``placement``'s arenas: param (none where
    gathers cast the master), grad (host only: the device's are counted apart, ``ArenaBytes.grads``),
    the moments, and an fp32 master unless it is the param (fp32)."""
    elt = torch.empty((), dtype=dtype).element_size()
    param = 0 if casts_on_gather(placement, dtype) else elt
    grad = 0 if grads_on_demand(placement) else elt
    return numel * (param + grad) + state.nbytes(numel, master=dtype != torch.float32)


@dataclass(frozen=True)
class WindowStep:
    """One backward segment as the gradient shards meet it."""

    slack: int
    """Activation bytes of the profiled peak no longer alive at this segment's own peak, times
    ``F_ALLOC / F_FRAG``: what gradient shards allocated by then may take."""
    params: tuple[str, ...]
    """Parameters whose gradients arrive in this segment (their chunks' shards exist from here on)."""


@dataclass(frozen=True)
class GradWindow:
    """When the GPU's gradient shards appear in backward and what activation memory is free by then
    ([Note: gradient window]); no steps: every gradient counts beside the activations."""

    steps: tuple[WindowStep, ...] = ()

    @property
    def shares(self) -> bool:
        """Some gradient shards are planned into memory the activations free."""
        return any(s.slack > 0 for s in self.steps)


def grad_window(
    activation_peak: int, backward: list[BackwardSegment], f_alloc: float, f_frag: float, micro_batches: int
) -> GradWindow:
    """The window of a profiled step: none with gradient accumulation (the gradients stay through
    the next micro-batches' forwards) or when the profile found no head (``backward`` empty)."""
    if micro_batches > 1 or not backward:
        return GradWindow()
    return GradWindow(
        tuple(WindowStep(int(f_alloc * max(0, activation_peak - b.peak) / f_frag), tuple(b.params)) for b in backward)
    )


class ArenaBytes:
    """Per-chunk arena sizes of one layout, for fast sums over placements."""

    def __init__(
        self,
        layout: ChunkLayout,
        dtype: torch.dtype,
        state: AdamState,
        lane: bool = False,
        window: GradWindow = GradWindow(),
    ) -> None:
        """``state``: the optimizer state of a trainable element; ``lane``: the device update lane is
        on (its staging buffers count while a trainable chunk is offloaded); ``window``: what the
        device's gradient shards share memory with."""
        elt = torch.empty((), dtype=dtype).element_size()
        self.elt, self.dtype, self.state, self.lane = elt, dtype, state, lane
        self.buffer = layout.block_numel * elt
        """Bytes of one rCache buffer (the largest public chunk, in the compute dtype)."""
        shard = np.array([layout.shard_numel(c) for c in layout.chunks], dtype=np.int64)
        trainable = np.array([c.trainable for c in layout.chunks])
        self.trainable_shard = np.where(trainable, shard, 0)
        self.device_arena, self.host_arena = (
            np.array(
                [trainable_bytes(int(n), dtype, where, state) if t else int(n) * elt for n, t in zip(shard, trainable)],
                dtype=np.int64,
            )
            for where in ("device", "host")
        )
        """Bytes of each chunk's arenas when it is on the device / offloaded."""
        self.grad = self.trainable_shard * elt
        """Bytes of each chunk's gradient shard when it is on the device."""
        index = {n: i for i, names in enumerate(layout.names) for n in names}
        self.slack = np.array([s.slack for s in window.steps] or [0], dtype=np.int64)
        self.step = np.zeros(len(layout.chunks), dtype=np.int64)
        """The window step each chunk's gradient shard exists from: the first to produce a gradient
        of one of its parameters; step 0 (the head, at the activation peak) for chunks no step names."""
        for i in reversed(range(len(window.steps))):
            self.step[list(layout.chunks_of(index[n] for n in window.steps[i].params if n in index))] = i
        self.private = int(sum(c.numel * elt for c in layout.chunks if c.private))

    def lane_numel(self, on_device: np.ndarray) -> int:
        """Elements per staging buffer of the device lane for this placement (0: no lane)."""
        return lane_numel([int(n) for n in self.trainable_shard[~on_device]]) if self.lane else 0

    def staging(self, on_device: np.ndarray) -> int:
        """Bytes of the device lane's staging buffers for this placement."""
        return staging_bytes(self.lane_numel(on_device), self.dtype, self.state)

    def grads(self, on_device: np.ndarray) -> int:
        """The device's gradient shards beyond the activations freed under them: at each step of
        the window, the shards existing by then less its slack; the most of these."""
        per_step = np.bincount(self.step[on_device], weights=self.grad[on_device], minlength=len(self.slack))
        return max(0, int((np.cumsum(per_step).round().astype(np.int64) - self.slack).max()))

    def device(self, n_blocks: int, on_device: np.ndarray) -> int:
        """rCache + private buffers + the arenas of the chunks placed on the device + their gradient
        shards beyond the activations' slack + lane staging: what the budget's ``allowed`` bounds."""
        return (
            n_blocks * self.buffer
            + self.private
            + int(self.device_arena[on_device].sum())
            + self.grads(on_device)
            + self.staging(on_device)
        )

    def host(self, on_device: np.ndarray) -> int:
        """Pinned host arenas of this rank."""
        return int(self.host_arena[~on_device].sum())
