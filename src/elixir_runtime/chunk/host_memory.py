"""Host memory for chunk arenas: on huge pages, pinned at its exact size.

``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds each
block up to a power of two (a 40 GiB arena would take 64 GiB of RAM). We allocate ordinary
pageable memory and page-lock it in place with ``cudaHostRegister`` instead.

[Note: huge pages]
The host arenas are tens of GB that the CPU Adam streams through every step and the fill touches
first. Where the kernel's transparent huge pages are in ``madvise`` mode (Ubuntu's default), memory
gets 2 MiB pages only where it is asked for: ``empty_arena`` advises its range before the first
touch, so the fill faults 512x fewer pages and the update misses the TLB less. The advice is a
hint: where THP is ``never`` or absent the call fails and the arena keeps small pages, unchanged
otherwise. (torch's ``THP_MEM_ALLOC_ENABLE`` does this for every CPU allocation of the process,
the user's included; the engine asks for its own arenas only.)
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import warnings
import weakref

import torch

__all__ = ["empty_arena", "empty_host", "pin_host", "unpin_host"]

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
"""``<sys/mman.h>``: back this range with transparent huge pages."""


def empty_arena(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An untouched host tensor advised onto huge pages (Note: huge pages)."""
    t = torch.empty(numel, dtype=dtype)
    _advise_huge_pages(t)
    return t


def _advise_huge_pages(t: torch.Tensor) -> None:
    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if hi - lo < 2**21:  # less than one huge page
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) != 0:
        logger.debug(
            "elixir: madvise(MADV_HUGEPAGE) failed (errno %d): the arena keeps small pages", ctypes.get_errno()
        )


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
    _REGISTERED[ptr] = weakref.finalize(t, cudart.cudaHostUnregister, ptr)  # the engine keeps the arena tensor alive


_REGISTERED: dict[int, weakref.finalize] = {}  # type: ignore[type-arg]  # finalize's type parameters vary by typeshed
"""The page-locked arenas by address, each with its unregistering finalizer."""


def unpin_host(t: torch.Tensor) -> None:
    """Unregisters ``t``'s memory from CUDA now if ``pin_host`` registered it (before freeing it
    while the tensor lives: ``elixir_runtime.release``); nothing otherwise."""
    done = _REGISTERED.pop(t.data_ptr(), None)
    if done is not None:
        done()
