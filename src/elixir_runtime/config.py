"""User-facing configuration of the engine: what to run, not how it is laid out.

``ElixirConfig()`` means: automatic plan, compute in the model's own dtype. Every field of a
*static* plan can be forced here so that tests (and users who know better) get any shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.distributed as dist

__all__ = ["ElixirConfig", "LossScaleConfig", "PlanError", "offloaded_chunks"]

BlockCount = int | Literal["min", "max"]


class PlanError(ValueError):
    """The requested plan cannot run; the message names the numbers and the fix."""


@dataclass(kw_only=True, frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, used only when the compute dtype is float16 (defaults as torch's GradScaler)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0


@dataclass(kw_only=True, frozen=True)
class ElixirConfig:
    """How ``elixir_runtime.prepare`` trains a model.

    ``mode="auto"`` derives whatever is left ``None`` from the model, the batch and the machine;
    ``mode="static"`` requires nothing more but uses exactly what is given (``None`` then means
    the simple default: chunk size from the model, rCache max, nothing offloaded).
    """

    mode: Literal["auto", "static"] = "auto"
    dtype: torch.dtype | str | None = None
    """Compute dtype of the gathered params (and so of activations). ``None``: the model's own dtype,
    never a silent precision change. ``"bf16"``/``"fp16"``: mixed precision with fp32 master weights."""

    chunk_size: int | None = None
    """Elements per chunk (rounded up to a multiple of ``world_size * alignment``)."""

    n_blocks: BlockCount | None = None
    """rCache size in chunks: an int, ``"min"`` (largest hooked unit) or ``"max"`` (every chunk)."""

    offload: float | Sequence[int] | None = None
    """Which chunks keep their shard and optimizer states in (pinned) host memory and are updated on
    the CPU: a fraction of the chunks (the ones whose gradients arrive first in backward) or
    explicit chunk indices. ``0`` keeps everything on the compute device."""

    prefetch: int = 1
    """How many upcoming chunks to gather ahead of use on side streams."""

    unit_classes: Sequence[type | str] | None = None
    """Module classes (or class names) hooked as one fetch unit, FSDP2 style. ``None``: the model's
    ``_no_split_modules`` (its transformer blocks), and every other module holding parameters."""

    device: torch.device | str | None = None
    """Compute device. ``None``: ``cuda:<LOCAL_RANK>`` if CUDA is available, else CPU."""

    process_group: dist.ProcessGroup | None = None
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    alignment: int = 64
    """Each parameter starts at a multiple of this many elements inside its chunk (fast kernels)."""

    cpu_threads: int | None = None
    """Threads of the CPU Adam of offloaded chunks. ``None``: this rank's share of the host's cores
    less one for the training loop (``optim/threads.py``), whatever ``OMP_NUM_THREADS`` says."""

    clips_grads: bool = True
    """Whether the training loop calls ``clip_grad_norm`` (or trains in fp16): one host sync before
    the update, so the CPU Adam of offloaded chunks starts only after backward; the planner
    predicts the overlap accordingly. ``False`` (no clipping, bf16/fp32): the host runs ahead of
    the GPU and those updates start during backward, as each chunk's gradients land."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "static"):
            raise ValueError(f"ElixirConfig.mode must be 'auto' or 'static', got {self.mode!r}")
        if isinstance(self.n_blocks, str) and self.n_blocks not in ("min", "max"):
            raise ValueError(f"ElixirConfig.n_blocks must be an int, 'min' or 'max', got {self.n_blocks!r}")
        if isinstance(self.n_blocks, int) and self.n_blocks < 1:
            raise ValueError(f"ElixirConfig.n_blocks must be >= 1, got {self.n_blocks}")
        if isinstance(self.offload, float | int) and not isinstance(self.offload, bool):
            if not 0.0 <= float(self.offload) <= 1.0:
                raise ValueError(f"ElixirConfig.offload as a fraction must lie in [0, 1], got {self.offload}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"ElixirConfig.chunk_size must be positive, got {self.chunk_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"ElixirConfig.cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.prefetch < 0:
            raise ValueError(f"ElixirConfig.prefetch must be >= 0, got {self.prefetch}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype) if self.dtype is not None else None)  # frozen


def offloaded_chunks(offload: float | Sequence[int], n_chunks: int, chunk_size: int) -> list[int]:
    """``ElixirConfig.offload`` for a layout of ``n_chunks``: a fraction takes the last chunks (their
    gradients arrive first in backward), a list is checked against the layout."""
    if isinstance(offload, (float, int)) and not isinstance(offload, bool):
        return list(range(n_chunks - round(float(offload) * n_chunks), n_chunks))
    chunks = sorted({int(i) for i in offload})
    bad = [i for i in chunks if not 0 <= i < n_chunks]
    if bad:
        raise PlanError(f"offload names chunks {bad}, but with chunks of {chunk_size:,} elements the layout "
                        f"has chunks 0..{n_chunks - 1}: give chunk_size too, or offload as a fraction")
    return chunks


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accepts torch dtypes and the usual short names; rejects anything that is not a float dtype we train in."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype
