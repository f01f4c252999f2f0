"""Picks the Adam kernel for an arena's device, falling back to the torch reference loudly.

CUDA -> TritonAdamKernel (if triton imports), CPU -> CpuAdamKernel (if it builds). Set
``ELIXIR_ADAM_KERNEL=torch`` to force TorchAdamKernel everywhere (debugging, bisecting).
``cpu_kernel_status`` / ``gpu_kernel_status`` say which kernel a device gets here and why
(``python -m elixir_hf.commands.env``).
"""

from __future__ import annotations

import os
import warnings
from functools import cache

import torch

from .kernel import AdamKernel, TorchAdamKernel

__all__ = ["select_kernel", "cpu_kernel_status", "gpu_kernel_status"]

ENV = "ELIXIR_ADAM_KERNEL"
_CHOICES = ("auto", "torch")


@cache
def _cpu_kernel(threads: int | None) -> AdamKernel:
    from .cpu_adam import CpuAdamKernel, CpuAdamUnavailable

    try:
        return CpuAdamKernel(threads=threads)
    except CpuAdamUnavailable as err:
        warnings.warn(
            f"\n{'!' * 78}\nelixir: the C++ CPU Adam kernel is unavailable, so offloaded optimizer steps use the "
            f"torch reference, several times slower. Why: {err}\nCheck with `python -m elixir_hf.commands.env`; "
            f"{ENV}=torch silences this.\n{'!' * 78}",
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


def _forced_torch() -> bool:
    return os.environ.get(ENV, "auto").strip().lower() == "torch"


def cpu_kernel_status() -> tuple[str, str]:
    """``("cpp" | "torch", why)``: the kernel ``select_kernel("cpu")`` gives in this environment,
    building the C++ kernel if it is not built yet (no warning: the reason is returned)."""
    from .cpu_adam import CpuAdamUnavailable, library_path, load_library

    if _forced_torch():
        return "torch", f"{ENV}=torch"
    try:
        lib = load_library()
    except CpuAdamUnavailable as err:
        return "torch", str(err)
    return "cpp", f"{lib.elixir_adam_isa().decode()} build, {library_path()}"


def gpu_kernel_status() -> tuple[str, str]:
    """``("triton" | "torch", why)``: the kernel ``select_kernel("cuda")`` gives in this environment
    (triton importable or not), and whether there is a CUDA device to run it on."""
    if _forced_torch():
        return "torch", f"{ENV}=torch"
    try:
        import triton

        from . import triton_adam  # noqa: F401
    except ImportError as err:
        return "torch", f"triton is not importable ({err}). Fix: pip install triton (it comes with CUDA torch wheels)"
    where = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device here"
    return "triton", f"triton {triton.__version__} imports; {where}"
