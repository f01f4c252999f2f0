"""The C++ CPU Adam kernel: float64 parity for every dtype pair and ISA, bitwise agreement across
ISAs/threads/tiles, exact 16-bit conversions, input checks and the no-compiler path."""

from __future__ import annotations

import pytest
import torch
from adam_cases import (
    GRAD_DTYPES,
    OUT_DTYPES,
    check_against_reference,
    make_arena,
    make_segments,
    run_kernel,
)

from elixir_runtime.adam_state import ADAM_STATE, AdamTensors
from elixir_runtime.chunk.layout import GroupRange
from elixir_runtime.kernels import cpu_adam
from elixir_runtime.kernels.cpu_adam import CpuAdamKernel, CpuAdamUnavailable
from elixir_runtime.kernels.kernel import AdamHyper, TorchAdamKernel

_FLAGS = set(cpu_adam._cpu_flags().split())
ISAS = ["native", "scalar"] + (["avx2"] if "avx2" in _FLAGS else []) + (["avx512"] if "avx512f" in _FLAGS else [])
# Odd lengths around the vector widths, plus long ones so two threads and several blocks run.
LENGTHS = [1, 37, 15, 16, 17, 1000, 4097, 33, 70001, 3, 8, 9]
BIG_LENGTHS = [300_001, 7, 262_145, 65, 129]


def _kernel(isa: str, threads: int = 2) -> CpuAdamKernel:
    return CpuAdamKernel(isa=isa, threads=threads)


def _state(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> AdamTensors:
    return AdamTensors(ADAM_STATE["fp32"], {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_matches_float64_reference(isa: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    segments, numel = make_segments(LENGTHS)
    start = make_arena(numel, grad_dtype, out_dtype)
    result = start.clone()
    run_kernel(_kernel(isa), result, segments)
    check_against_reference(result, start, segments)


def test_torch_reference_kernel_matches_float64_too() -> None:
    """The tolerances are fair: torch's own fp32 math (TorchAdamKernel) passes the same check."""
    segments, numel = make_segments(LENGTHS)
    start = make_arena(numel, torch.bfloat16, torch.bfloat16)
    result = start.clone()
    run_kernel(TorchAdamKernel(), result, segments)
    check_against_reference(result, start, segments)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_bitwise_same_across_isas_and_threads(grad_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    segments, numel = make_segments(BIG_LENGTHS)
    start = make_arena(numel, grad_dtype, out_dtype, seed=1)
    expected = start.clone()
    run_kernel(_kernel("native", threads=2), expected, segments)
    for isa, threads in [(isa, 2) for isa in ISAS] + [("native", 1), ("native", 3)]:
        got = start.clone()
        run_kernel(_kernel(isa, threads), got, segments)
        for name in ("master", "exp_avg", "exp_avg_sq", "out"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (isa, threads, name)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_grad_decoding_is_exact_for_every_bit_pattern(isa: str, grad_dtype: torch.dtype) -> None:
    """With beta1 = 0, exp_avg after one step is the decoded grad: check all 65536 patterns."""
    grad = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = grad.numel()
    master, exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    hyper = AdamHyper(lr=0.0, beta1=0.0, beta2=0.5, eps=1e-8, weight_decay=0.0, decoupled=True)
    _kernel(isa).step(_state(master, exp_avg, exp_avg_sq), grad, None, [GroupRange(0, n, 0)], [hyper], 1, 1.0)
    torch.testing.assert_close(exp_avg, grad.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_param_out_rounds_like_torch(isa: str, out_dtype: torch.dtype) -> None:
    """lr = 0 keeps the master as it is, so the output must be ``master.to(dtype)`` bit for bit:
    random fp32 bit patterns (NaN, inf, subnormals, ties) plus fp16 overflow and subnormal values."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor(
        [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e5, -1e5, 6e-8, 3e-8, 2.98e-8, 1e-40, 1.00390625, 1.01171875]
    )
    master = torch.cat([bits.view(torch.float32), special, torch.randn(4097, generator=gen) * 1e-5])
    n = master.numel()
    expected = master.to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    hyper = AdamHyper(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    state = _state(master, torch.zeros(n), torch.zeros(n))
    _kernel(isa).step(state, torch.zeros(n), out, [GroupRange(0, n, 0)], [hyper], 1, 1.0)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_rejects_bad_inputs() -> None:
    kernel, n = _kernel("native"), 64
    f = lambda: torch.zeros(n)  # noqa: E731
    hyper = [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]
    seg = [GroupRange(0, n, 0)]
    with pytest.raises(ValueError, match="master"):
        kernel.step(_state(torch.zeros(n, dtype=torch.float64), f(), f()), f(), None, seg, hyper, 1, 1.0)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        kernel.step(_state(f(), f(), torch.zeros(n, dtype=torch.bfloat16)), f(), None, seg, hyper, 1, 1.0)
    with pytest.raises(ValueError, match="grad"):
        kernel.step(_state(f(), f(), f()), torch.zeros(2 * n)[::2], None, seg, hyper, 1, 1.0)
    with pytest.raises(ValueError, match="param_out"):
        kernel.step(_state(f(), f(), f()), f(), torch.zeros(n), seg, hyper, 1, 1.0)
    with pytest.raises(ValueError, match="segments need"):
        kernel.step(_state(f(), f(), f()), f(), None, [GroupRange(1, n, 0)], hyper, 1, 1.0)
    with pytest.raises(ValueError, match="segments need"):
        kernel.step(_state(f(), f(), f()), f(), None, [GroupRange(0, n, 1)], hyper, 1, 1.0)
    with pytest.raises(ValueError, match="1-based"):
        kernel.step(_state(f(), f(), f()), f(), None, seg, hyper, 0, 1.0)
    with pytest.raises(ValueError, match="CPU arenas"):
        kernel.step(_state(*(torch.zeros(n, device="meta") for _ in range(3))), f(), None, seg, hyper, 1, 1.0)


def test_no_compiler_raises_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-elixir")
    with pytest.raises(CpuAdamUnavailable, match="no C\\+\\+ compiler.*Fix: install g\\+\\+ with OpenMP"):
        cpu_adam._load.__wrapped__("native")


def test_compile_error_raises_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # on PATH, always fails
    with pytest.raises(CpuAdamUnavailable, match="failed.*Fix: install g\\+\\+ with OpenMP"):
        cpu_adam._load.__wrapped__("native")
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left to load later


def test_missing_openmp_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A compiler without OpenMP (clang without libomp) fails on omp.h: the reason says so."""
    fake = tmp_path / "cxx-without-openmp"
    fake.write_text("#!/bin/sh\necho 'fatal error: omp.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(CpuAdamUnavailable, match="the compiler has no OpenMP"):
        cpu_adam._load.__wrapped__("native")


def test_missing_ninja_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: False)
    with pytest.raises(CpuAdamUnavailable, match="pip install ninja"):
        cpu_adam._load.__wrapped__("native")


def test_build_directory_is_keyed_by_torch_cpu_and_isa(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    native = cpu_adam.build_directory("native")
    assert native.parent == tmp_path / "elixir_cpu_adam" and native.name.startswith(torch.__version__ + "-")
    assert cpu_adam.build_directory("scalar") != native
    monkeypatch.setattr(cpu_adam, "_cpu_flags", lambda: "fpu sse2")
    assert cpu_adam.build_directory("native") != native
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_adam.load_library("avx1024")


def test_segment_tables_are_bounded() -> None:
    """Parameters without a gradient give other segment lists each step; the kernel keeps at most
    TABLE_CACHE tables, and a dropped one is rebuilt when it comes back."""
    from elixir_runtime.kernels.kernel import TABLE_CACHE

    kernel = CpuAdamKernel(threads=1)
    arena = make_arena(200, torch.float32, None)
    for i in range(TABLE_CACHE + 10):
        run_kernel(kernel, arena.clone(), (GroupRange(i, 3, 0),))
    assert len(kernel._tables) == TABLE_CACHE
    assert (GroupRange(0, 3, 0),) not in kernel._tables and (GroupRange(TABLE_CACHE + 9, 3, 0),) in kernel._tables


def test_only_a_missing_openmp_is_called_one() -> None:
    """Every compile line ninja echoes has -fopenmp: only what a compiler without OpenMP says counts."""
    assert cpu_adam._why_build_failed("fatal error: omp.h: No such file or directory") == "the compiler has no OpenMP"
    assert cpu_adam._why_build_failed("/usr/bin/ld: cannot find -lgomp") == "the compiler has no OpenMP"
    assert cpu_adam._why_build_failed("clang: error: unsupported option '-fopenmp'") == "the compiler has no OpenMP"
    assert cpu_adam._why_build_failed("c++ -O3 -fopenmp -c cpu_adam.cpp\nerror: expected ';'") == "the compiler failed"
