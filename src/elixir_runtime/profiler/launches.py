"""Custom kernels met by a fake-tensor trace: skipped, never launched, their traffic counted.

[Note: kernels on fake tensors] A fake tensor has a shape but no memory, and a Triton kernel
(Liger's RMSNorm, SwiGLU, RoPE and fused linear cross entropy; any ``@triton.jit`` function called
from a model's forward) is launched on raw pointers, outside torch's dispatcher, where the fake mode
cannot see it: launched on fakes it reads and writes wherever their pointers say, and on a GPU the
illegal access poisons the CUDA context for the rest of the process. Such a kernel only fills tensors
its caller allocated through torch (which the trace does see, so the memory count is right), so the
trace skips the launch: every ``kernel[grid](...)`` call whose arguments hold a fake tensor returns
without running, and its cost is its traffic, each distinct tensor argument read or written once,
at the device's memory bandwidth (the kernels Liger and its peers write for training are fused
elementwise and reduction kernels; their matmuls run through torch and are counted as matmuls).

The caller's data-dependent scalars come with it: a loss that divides by ``mask.sum().item()`` (the
count of non-ignored labels) cannot be read off fakes. ``fake.fake_run`` answers a number's
``item()`` with 1 and ``torch.equal`` with True (``fake._DATA_ANSWERS``): a divisor stays non-zero,
and Liger's backward takes its path for a loss's own gradient. A truth value is not answered.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["Launch", "skipped_launches"]

Launch = Callable[[int], None]
"""Told of each skipped launch: the bytes of its distinct tensor arguments."""


def _fake_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The bytes of the distinct fake tensors among a launch's arguments; ``None`` if there are none."""
    seen: dict[int, int] = {}
    for a in (*args, *kwargs.values()):
        if isinstance(a, FakeTensor):
            seen[id(a.untyped_storage())] = a.untyped_storage().nbytes()
    return sum(seen.values()) if seen else None


@contextlib.contextmanager
def skipped_launches(on_launch: Launch | None = None) -> Iterator[None]:
    """Inside it, a Triton launch (``kernel[grid](*args)``) with a fake tensor among its arguments
    does not run; ``on_launch`` is told of it. Launches on real tensors run as usual. Without
    Triton installed there is nothing to skip."""
    if importlib.util.find_spec("triton") is None:
        yield
        return
    from triton.runtime.jit import KernelInterface  # every launchable Triton object derives from it

    real_getitem = KernelInterface.__getitem__

    def getitem(kernel: Any, grid: Any) -> Callable[..., Any]:
        launch = real_getitem(kernel, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            nbytes = _fake_bytes(args, kwargs)
            if nbytes is None:
                return launch(*args, **kwargs)
            if on_launch is not None:
                on_launch(nbytes)
            return None

        return run

    KernelInterface.__getitem__ = getitem
    try:
        yield
    finally:
        KernelInterface.__getitem__ = real_getitem
