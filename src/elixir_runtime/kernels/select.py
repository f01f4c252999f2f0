"""Picks the Adam kernel for an arena's device, falling back to the torch reference loudly.

CUDA -> TritonAdamKernel (if triton imports), CPU -> CpuAdamKernel (if it builds). Set
``ELIXIR_ADAM_KERNEL=torch`` to force TorchAdamKernel everywhere (debugging, bisecting).
"""

from __future__ import annotations

import os
import warnings
from functools import cache

import torch

from .kernel import AdamKernel, TorchAdamKernel

__all__ = ["select_kernel"]

ENV = "ELIXIR_ADAM_KERNEL"
_CHOICES = ("auto", "torch")


@cache
def _cpu_kernel(threads: int | None) -> AdamKernel:
    from .cpu_adam import CpuAdamKernel, CpuAdamUnavailable

    try:
        return CpuAdamKernel(threads=threads)
    except CpuAdamUnavailable as err:
        warnings.warn(
            f"elixir: the C++ CPU Adam kernel is unavailable, using the slow torch reference for "
            f"offloaded optimizer steps (several times slower). Reason: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return TorchAdamKernel()


@cache
def _gpu_kernel() -> AdamKernel:
    try:
        from .triton_adam import TritonAdamKernel
    except ImportError as err:
        warnings.warn(
            f"elixir: triton is not importable, using the torch reference for GPU optimizer steps: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return TorchAdamKernel()
    return TritonAdamKernel()


def select_kernel(device: torch.device | str, threads: int | None = None) -> AdamKernel:
    """The fastest working kernel for arenas on ``device`` (one shared instance per kind);
    ``threads``: OpenMP threads of the CPU kernel (``None``: ``torch.get_num_threads()``)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV} must be one of {_CHOICES}, got {choice!r}")
    if choice == "torch":
        return TorchAdamKernel()
    device = torch.device(device)
    if device.type == "cuda":
        return _gpu_kernel()
    if device.type == "cpu":
        return _cpu_kernel(threads)
    return TorchAdamKernel()
