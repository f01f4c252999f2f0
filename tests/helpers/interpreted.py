"""The Triton Adam kernel on the CPU, through Triton's interpreter."""

from __future__ import annotations

import functools
import importlib.util
import types


@functools.cache
def interpreted_triton_adam() -> types.ModuleType:
    """A private copy of ``elixir_runtime.kernels.triton_adam`` whose kernels were decorated with
    ``TRITON_INTERPRET=1`` set (the caller sets it, and keeps it set while launching), so that they
    run on CPU tensors; the normally imported module stays compiled for GPU tests."""
    spec = importlib.util.find_spec("elixir_runtime.kernels.triton_adam")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
