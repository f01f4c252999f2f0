"""The fake-tensor trace of a model with custom kernels and patched forwards, as Liger makes them
(``profiler/launches.py``, ``profiler/outside.py``): a Triton kernel is not launched on fake tensors
but counted by its traffic, ``item()`` of a count is answered, and a parameter read outside its
module's call is found and given a chunk the root gathers, with no name of Liger's or TRL's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elixir_runtime.profiler.launches import skipped_launches
from elixir_runtime.profiler.profile import profile_model
from helpers.models import make_batch, read_head_outside, tiny_llama

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


_copy = triton.jit(_copy_kernel)


class _TritonCopy(torch.autograd.Function):
    """``x`` copied by a Triton kernel into a tensor torch allocated, as Liger's ops are built."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        _copy[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Net(nn.Module):
    def __init__(self, triton_copy: bool) -> None:
        super().__init__()
        self.first, self.last, self.triton_copy = nn.Linear(64, 64), nn.Linear(64, 64), triton_copy

    def forward(self, x):
        h = self.first(x)
        h = _TritonCopy.apply(h) if self.triton_copy else h.clone()
        return self.last(h)


def test_a_triton_kernel_is_skipped_on_fakes_and_costs_its_traffic() -> None:
    """Launched on fake CPU tensors the kernel would fail (no driver here; on a GPU, an illegal
    access that poisons the process): skipped, the step traces as the torch twin doing the same copy,
    the same activation peak and bytes moved."""
    x = torch.randn(8, 64)
    launched = profile_model(_Net(triton_copy=True), x, device="cpu")
    twin = profile_model(_Net(triton_copy=False), x, device="cpu")
    assert launched.activation_peak == twin.activation_peak
    assert launched.compute["fwd"].bytes == twin.compute["fwd"].bytes
    assert launched.compute["fwd"].total_flops == twin.compute["fwd"].total_flops


def test_a_launch_on_real_tensors_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only launches on fakes are skipped: inside the context a real launch (Triton's interpreter,
    on the CPU) copies."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    copy = triton.jit(_copy_kernel)
    seen: list[int] = []
    x, out = torch.arange(300, dtype=torch.float32), torch.zeros(300)
    with skipped_launches(seen.append):
        copy[(2,)](x, out, 300, BLOCK=256)
    assert torch.equal(out, x) and seen == []


def test_a_read_outside_its_module_is_found() -> None:
    model = tiny_llama()
    read_head_outside(model)
    batch = make_batch(128)
    profile = profile_model(model, batch, device="cpu")
    assert profile.read_outside == ["lm_head.weight"]
    plain = profile_model(tiny_llama(), batch, device="cpu")
    assert plain.read_outside == []  # the stock forward calls its head
