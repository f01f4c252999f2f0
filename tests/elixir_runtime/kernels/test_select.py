"""select_kernel: the right kernel per device, the env override, and loud fallbacks."""

from __future__ import annotations

import sys

import pytest
import torch

from elixir_runtime.kernels import cpu_adam, select
from elixir_runtime.kernels.cpu_adam import CpuAdamKernel
from elixir_runtime.kernels.kernel import TorchAdamKernel
from elixir_runtime.kernels.select import select_kernel


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch: pytest.MonkeyPatch):
    """Each test sees its own environment; later tests get the real kernels back."""
    monkeypatch.delenv(select.ENV, raising=False)
    caches = (select._cpu_kernel, select._gpu_kernel, cpu_adam._load)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def test_cpu_gets_the_cpp_kernel() -> None:
    kernel = select_kernel(torch.device("cpu"))
    assert isinstance(kernel, CpuAdamKernel)
    assert select_kernel("cpu") is kernel  # built once, shared


def test_env_forces_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select.ENV, "torch")
    assert isinstance(select_kernel(torch.device("cpu")), TorchAdamKernel)
    assert isinstance(select_kernel(torch.device("cuda")), TorchAdamKernel)


def test_env_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(select.ENV, "fast")
    with pytest.raises(ValueError, match=select.ENV):
        select_kernel(torch.device("cpu"))


def test_no_compiler_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-elixir")
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU Adam kernel is unavailable"):
        kernel = select_kernel(torch.device("cpu"))
    assert isinstance(kernel, TorchAdamKernel)


def test_broken_compiler_falls_back_loudly_naming_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.warns(
        RuntimeWarning, match="(?s)several times slower. Why: building .* failed.*Fix: install g\\+\\+ with OpenMP"
    ):
        kernel = select_kernel(torch.device("cpu"))
    assert isinstance(kernel, TorchAdamKernel)
    assert select.cpu_kernel_status()[0] == "torch"


def test_cuda_without_triton_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.delitem(sys.modules, "elixir_runtime.kernels.triton_adam", raising=False)
    with pytest.warns(RuntimeWarning, match="triton is not importable"):
        kernel = select_kernel(torch.device("cuda"))
    assert isinstance(kernel, TorchAdamKernel)


@pytest.mark.gpu
def test_cuda_gets_the_triton_kernel() -> None:
    from elixir_runtime.kernels.triton_adam import TritonAdamKernel

    assert isinstance(select_kernel(torch.device("cuda", 0)), TritonAdamKernel)
