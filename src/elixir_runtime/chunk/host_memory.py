"""Pinned host memory allocated at its exact size.

``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds each
block up to a power of two (a 40 GiB arena would take 64 GiB of RAM). We allocate ordinary
pageable memory and page-lock it in place with ``cudaHostRegister`` instead.
"""

from __future__ import annotations

import warnings
import weakref

import torch

__all__ = ["empty_host", "pin_host"]


def empty_host(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A zero-filled host tensor; page-locked (exact size) when ``pin`` and CUDA is available."""
    t = torch.zeros(numel, dtype=dtype)
    return pin_host(t) if pin else t


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` page-locked in place where CUDA is available (its values kept); a pinned copy where
    ``cudaHostRegister`` is not; ``t`` itself without CUDA."""
    if t.numel() == 0 or not torch.cuda.is_available():
        return t
    try:
        _register(t)
    except (RuntimeError, AttributeError) as exc:
        warnings.warn(
            f"cudaHostRegister unavailable ({exc}); falling back to the caching pinned allocator", stacklevel=2
        )
        return t.pin_memory()
    return t


def _register(t: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {int(err)}")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)  # the engine keeps the arena tensor alive
