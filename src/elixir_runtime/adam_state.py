"""The optimizer state a trainable element carries, described once.

Every reader of Adam's state (the planner's memory and step model, the chunk store's arenas, the
kernels, the device lane's staging, the checkpoint format and ``elixir-convert``) takes the tensors,
their dtypes and their bytes per element from :data:`ADAM_STATE` here, by ``ElixirConfig.moments``:

    ``"fp32"`` (exact, the default)   master fp32, exp_avg fp32, exp_avg_sq fp32          12 bytes
    ``"8bit"``                        master fp32, exp_avg / exp_avg_sq as uint8 codes of a
                                      block-wise dynamic map, each block's absmax in fp32  ~6.03 bytes

[Note: 8-bit moments]
The master stays fp32 and the update is computed in fp32 exactly as in the exact mode: only the
stored moments are compact. Each moment is cut into blocks of ``QUANT_BLOCK`` elements; a block
stores one fp32 scale (the largest magnitude of its new values) and a byte per element, the index
of the nearest value of a fixed 256-entry map of [-1, 1] (``exp_avg``, signed) or [0, 1]
(``exp_avg_sq``) after dividing by the scale. The maps are dynamic (a decade per exponent, linear
inside it: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"), so small moments
keep their relative precision; ``kernels/quant8.py`` builds them.

Blocks are counted from each parameter's first element: the layout aligns every parameter and every
rank's shard to ``QUANT_BLOCK`` elements (``AdamState.alignment``), so a block never holds two
parameters, the arena's blocks are the parameter's own, and a checkpoint stores each parameter's
codes and scales as they are, loadable bit for bit into any layout or rank count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["Moments", "MOMENTS", "QUANT_BLOCK", "StateTensor", "AdamState", "ADAM_STATE", "adam_state", "AdamTensors"]

Moments = Literal["fp32", "8bit"]
"""How Adam's two moments are stored (``ElixirConfig.moments``)."""
MOMENTS: tuple[str, ...] = get_args(Moments)

QUANT_BLOCK = 256
"""Elements of a moment that share one fp32 scale in the ``"8bit"`` state."""
SIGNED_ZERO = 127
"""The code of 0.0 in ``exp_avg``'s signed map (127 negative entries below it: ``kernels/quant8.py``)."""


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a parameter's optimizer state, seen as the flattened parameter."""

    kind: str
    """Its name in arenas and checkpoints (``{param}.{kind}``)."""
    dtype: torch.dtype
    per: int = 1
    """Elements one entry covers: 1, or ``QUANT_BLOCK`` for a block's scale."""
    moment: bool = True
    """A moment (zero at step 0), not the master weights."""
    zero: int = 0
    """The entry that stands for 0.0: what an arena of it starts as (the signed map's code of 0 is not 0)."""

    def entries(self, numel: int) -> int:
        """Entries of this tensor for ``numel`` elements."""
        return -(-numel // self.per)

    def span(self, start: int, end: int) -> slice:
        """The entries holding elements ``[start, end)`` (``start`` block-aligned where ``per`` > 1)."""
        if start % self.per:
            raise ValueError(
                f"{self.kind} is stored per {self.per} elements: a range must start at a multiple, not {start}"
            )
        return slice(start // self.per, self.entries(end))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class AdamState:
    """The tensors of one way of storing Adam's state, in arena and checkpoint order."""

    moments: Moments
    tensors: tuple[StateTensor, ...]

    @property
    def alignment(self) -> int:
        """Elements every parameter and shard starts at a multiple of (the quantization block)."""
        return max(t.per for t in self.tensors)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(t.kind for t in self.tensors)

    @property
    def quantized(self) -> bool:
        return self.alignment > 1

    def tensor(self, kind: str) -> StateTensor:
        return next(t for t in self.tensors if t.kind == kind)

    def bytes_per_element(self, *, master: bool = True) -> float:
        """Bytes of state per trainable element (``master=False``: the moments only, as where the
        fp32 master is the parameter itself)."""
        return sum(t.itemsize / t.per for t in self.tensors if master or t.moment)

    def nbytes(self, numel: int, *, master: bool = True) -> int:
        """Exact bytes of state for an arena of ``numel`` elements."""
        return sum(t.entries(numel) * t.itemsize for t in self.tensors if master or t.moment)


_MASTER = StateTensor("master", torch.float32, moment=False)

ADAM_STATE: dict[str, AdamState] = {
    "fp32": AdamState(
        "fp32", (_MASTER, StateTensor("exp_avg", torch.float32), StateTensor("exp_avg_sq", torch.float32))
    ),
    "8bit": AdamState(
        "8bit",
        (
            _MASTER,
            StateTensor("exp_avg", torch.uint8, zero=SIGNED_ZERO),
            StateTensor("exp_avg_sq", torch.uint8),
            StateTensor("exp_avg.absmax", torch.float32, per=QUANT_BLOCK),
            StateTensor("exp_avg_sq.absmax", torch.float32, per=QUANT_BLOCK),
        ),
    ),
}
"""Every way of storing the state, by ``ElixirConfig.moments``."""


def adam_state(moments: str) -> AdamState:
    """The state of ``moments``; ``ValueError`` naming the choices for another value."""
    try:
        return ADAM_STATE[moments]
    except (KeyError, TypeError):
        raise ValueError(
            f"moments={moments!r} is not a way of storing Adam's moments: choose one of {', '.join(map(repr, MOMENTS))} "
            '("fp32": exact AdamW; "8bit": fp32 master weights with block-wise 8-bit moments)'
        ) from None


@dataclass(eq=False)
class AdamTensors:
    """Optimizer state over one arena range: a flat tensor per kind of ``spec`` (scales per block)."""

    spec: AdamState
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, kind: str) -> torch.Tensor:
        return self.tensors[kind]

    @property
    def master(self) -> torch.Tensor:
        return self.tensors["master"]

    @property
    def numel(self) -> int:
        return self.master.numel()

    def range(self, lo: int, hi: int) -> AdamTensors:
        """Elements ``[lo, hi)`` as views (``lo`` a multiple of ``spec.alignment``)."""
        return AdamTensors(self.spec, {t.kind: self.tensors[t.kind][t.span(lo, hi)] for t in self.spec.tensors})

    def items(self) -> list[tuple[StateTensor, torch.Tensor]]:
        return [(t, self.tensors[t.kind]) for t in self.spec.tensors]
