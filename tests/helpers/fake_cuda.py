"""A GPU's memory as torch's caching allocator reports it, for the CPU tests of the GPU-limit path.

``FakeGPU.install`` replaces the ``torch.cuda`` queries that ``elixir_runtime.gpu_limit`` calls
(memory info, allocator statistics, the per-process memory fraction and its setter), so the code
under test runs its real calls against these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

GIB = 2**30


@dataclass
class FakeGPU:
    total: int = 80 * GIB
    used_elsewhere: int = GIB
    """CUDA context and other processes: not free, not this allocator's."""
    allocated: int = 0
    reserved: int = 0
    fraction: float = 1.0
    set_calls: int = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
        cuda = torch.cuda
        monkeypatch.setattr(
            cuda, "mem_get_info", lambda device=None: (self.total - self.used_elsewhere - self.reserved, self.total)
        )
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction)
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", self._set_fraction)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "Fake GPU")
        return self

    def _set_fraction(self, fraction: float, device=None) -> None:
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:  # as torch checks it
            raise ValueError(f"Invalid fraction value: {fraction}")
        self.fraction = fraction
        self.set_calls += 1


__all__ = ["FakeGPU", "GIB"]
