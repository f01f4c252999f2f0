"""The C++ CPU Adam with 8-bit moments ([Note: 8-bit kernel] in cpu_adam.cpp): exact against the fp32
kernel and quant8 on the same moments, close to the torch reference, bitwise the same across ISAs,
threads and alignment, padding untouched, tracking exact AdamW over steps, and bad inputs refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adam_cases import (
    DIV_SCALES,
    Arena8,
    covered_mask,
    hypers_at,
    make_arena8,
    make_segments8,
    run_kernel8,
)

from elixir_runtime.adam_state import ADAM_STATE, QUANT_BLOCK, AdamTensors
from elixir_runtime.chunk.layout import GroupRange
from elixir_runtime.kernels import cpu_adam, quant8
from elixir_runtime.kernels.adam_consts import step_constants
from elixir_runtime.kernels.cpu_adam import CpuAdamKernel, key_table
from elixir_runtime.kernels.kernel import AdamHyper, TorchAdamKernel

_FLAGS = set(cpu_adam._cpu_flags().split())
ISAS = ["native", "scalar"] + (["avx2"] if "avx2" in _FLAGS else []) + (["avx512"] if "avx512f" in _FLAGS else [])
# Odd lengths around the vector widths and the block (256), a block's multiples, one long segment.
LENGTHS = [1, 37, 15, 16, 17, 256, 1000, 4097, 33, 70001, 3, 8, 9, 512, 255, 257]
BIG_LENGTHS = [300_001, 7, 262_145, 65, 129, 4096]
KINDS = quant8.MOMENT_KINDS

# One step of the torch reference (TorchAdamKernel) from the same state: its op order differs from
# the fused fma order by an ulp here and there, which can move a value across a midpoint.
MASTER_RTOL, MASTER_ATOL = 1e-6, 1e-6
SCALE_RTOL = 1e-6
CODES_OFF = 1e-3
"""Most codes a step may differ from the reference's by (each by one code); 2e-4 seen."""
TRACK_TOL = 0.05
"""Largest |8-bit master - exact master| after 50 steps, as a fraction of the largest distance the
exact master moved (2.4 % seen: the moments' 8-bit rounding, not drift)."""


def _kernel(isa: str = "native", threads: int = 2) -> CpuAdamKernel:
    return CpuAdamKernel(isa=isa, threads=threads)


def _sentinels(arena: Arena8, segments: tuple[GroupRange, ...]) -> Arena8:
    """Padding (outside segments) set to values no kernel writes: codes 0xAB, untouched blocks'
    scales 123, master 5 (the grads there stay zero)."""
    n = arena.state.numel
    pad = ~covered_mask(segments, n)
    for kind in KINDS:
        arena.state[kind][pad] = 0xAB
        blocks = pad.view(-1, QUANT_BLOCK).all(dim=1)
        arena.state[f"{kind}.absmax"][blocks] = 123.0
    arena.state.master[pad] = 5.0
    return arena


def _check_padding(got: Arena8, start: Arena8, segments: tuple[GroupRange, ...]) -> None:
    pad = ~covered_mask(segments, got.state.numel)
    blocks = pad.view(-1, QUANT_BLOCK).all(dim=1)
    for t, x in got.state.items():
        untouched = blocks if t.per > 1 else pad
        assert torch.equal(x[untouched], start.state[t.kind][untouched]), t.kind
    if got.out is not None:
        assert start.out is not None and torch.equal(got.out[pad], start.out[pad])


def _fp32_from(state: AdamTensors) -> AdamTensors:
    """The exact state holding ``state``'s master and its dequantized moments."""
    moments = {k: quant8.dequantize(k, state[k], state[f"{k}.absmax"]) for k in KINDS}
    return AdamTensors(ADAM_STATE["fp32"], {"master": state.master.clone(), **moments})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "grad_dtype, out_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, None)],
    ids=str,
)
def test_equals_the_fp32_kernel_and_quant8(isa: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    """Each step, from the same moments: master and out bitwise the fp32 kernel's, codes and scales
    bitwise quant8.quantize of the fp32 kernel's new moments, padding untouched."""
    segments, n = make_segments8(LENGTHS)
    arena = _sentinels(make_arena8(n, segments, grad_dtype, out_dtype), segments)
    start = arena.clone()
    kernel = _kernel(isa)
    for step, (grad, div) in enumerate(zip(arena.grads, DIV_SCALES), start=1):
        exact = _fp32_from(arena.state)
        out = None if arena.out is None else arena.out.clone()
        kernel.step(exact, grad, out, segments, hypers_at(step), step, div)
        kernel.step(arena.state, grad, arena.out, segments, hypers_at(step), step, div)
        covered = covered_mask(segments, n)
        assert torch.equal(arena.state.master[covered], exact.master[covered])
        if out is not None:
            assert arena.out is not None and torch.equal(arena.out, out)
        for kind in KINDS:
            for s in segments:
                part = arena.state.range(s.offset, s.offset + s.length)
                codes, scales = quant8.quantize(kind, exact[kind][s.offset : s.offset + s.length])
                assert torch.equal(part[kind][: s.length], codes), (step, kind, s)
                assert torch.equal(part[f"{kind}.absmax"], scales), (step, kind, s)
    _check_padding(arena, start, segments)


@pytest.mark.parametrize("isa", ISAS)
def test_close_to_the_torch_reference(isa: str) -> None:
    """Each step from the same state as TorchAdamKernel (quant8 in torch ops): master and scales
    within a few ulps, codes equal but for a few off by one."""
    segments, n = make_segments8(LENGTHS)
    arena = make_arena8(n, segments, torch.bfloat16, torch.bfloat16)
    covered = covered_mask(segments, n)
    kernel, reference = _kernel(isa), TorchAdamKernel()
    for step, (grad, div) in enumerate(zip(arena.grads, DIV_SCALES), start=1):
        want = arena.clone()
        reference.step(want.state, grad, want.out, segments, hypers_at(step), step, div)
        kernel.step(arena.state, grad, arena.out, segments, hypers_at(step), step, div)
        torch.testing.assert_close(
            arena.state.master[covered], want.state.master[covered], rtol=MASTER_RTOL, atol=MASTER_ATOL
        )
        assert arena.out is not None and torch.equal(arena.out[covered], arena.state.master[covered].bfloat16())
        for kind in KINDS:
            off = (arena.state[kind].int() - want.state[kind].int())[covered]
            assert off.abs().max() <= 1 and (off != 0).float().mean() <= CODES_OFF, (step, kind)
            torch.testing.assert_close(
                arena.state[f"{kind}.absmax"], want.state[f"{kind}.absmax"], rtol=SCALE_RTOL, atol=0.0
            )


def test_bitwise_same_across_isas_threads_and_alignment() -> None:
    segments, n = make_segments8(BIG_LENGTHS)
    start = make_arena8(n, segments, torch.bfloat16, torch.bfloat16, seed=1)
    expected = start.clone()
    run_kernel8(_kernel("native", threads=2), expected, segments)
    for isa, threads, shift in [(isa, 2, 0) for isa in ISAS] + [("native", 1, 0), ("native", 3, 0), ("native", 2, 3)]:
        got = start.clone()
        if shift:  # param_out off the streaming stores' alignment: scalar steps first in every block
            assert got.out is not None
            got.out = torch.empty(n + shift, dtype=got.out.dtype)[shift:].copy_(got.out)
        run_kernel8(_kernel(isa, threads), got, segments)
        for kind, x in got.state.tensors.items():
            assert torch.equal(x, expected.state[kind]), (isa, threads, shift, kind)
        assert got.out is not None and expected.out is not None and torch.equal(got.out, expected.out)


def test_tracks_the_exact_kernel() -> None:
    """50 steps of 8-bit moments follow the exact fp32 moments' master within TRACK_TOL."""
    segments, n = make_segments8([1, 37, 1000, 4097, 70001, 300, 256, 513])
    arena = make_arena8(n, segments, torch.bfloat16, None)
    covered = covered_mask(segments, n)
    start = arena.state.master.clone()
    exact = AdamTensors(
        ADAM_STATE["fp32"], {"master": start.clone(), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    )
    kernel, gen = _kernel(), torch.Generator().manual_seed(5)
    for step in range(1, 51):
        grad = (torch.randn(n, generator=gen) * covered).bfloat16()
        kernel.step(arena.state, grad, None, segments, hypers_at(step), step, 1.0)
        kernel.step(exact, grad, None, segments, hypers_at(step), step, 1.0)
    gap = (arena.state.master - exact.master)[covered].abs().max()
    moved = (exact.master - start)[covered].abs().max()
    assert gap <= TRACK_TOL * moved, (float(gap), float(moved))


def test_key_table_gives_quant8s_codes() -> None:
    """The kernel's one lookup per code ([Note: one lookup per code]) reproduces quant8's bucket and
    midpoint rule for every key, at its ends, around each midpoint and at random values in [-1, 1]."""
    gen = np.random.default_rng(0)
    for kind in KINDS:
        t, key = quant8.tables(kind), key_table(kind).numpy().view(np.uint32)
        mid = t.mid.numpy()
        near = mid[:-1].view(np.uint32).astype(np.int64)[:, None] + np.arange(-2, 3)
        ends = (np.arange(1 << 16, dtype=np.int64)[:, None] << 16) | np.array([0, 1, 0x7FFF, 0xFFFE, 0xFFFF])
        bits = np.concatenate([near.ravel(), ends.ravel()]).astype(np.uint32)
        x = np.concatenate([bits.view(np.float32), gen.uniform(-1, 1, 1 << 16).astype(np.float32) ** 5])
        x = x[np.isnan(x) | (np.abs(x) <= 1)]
        b = x.view(np.uint32)
        entry = key[b >> 16]
        low = (b ^ (b.view(np.int32) >> 31).view(np.uint32)) & 0xFFFF
        got = (entry >> 16) + (low > (entry & 0xFFFF))
        base = t.bucket.numpy()[b >> 16].astype(np.int64)
        want = base + (x > mid[base])
        assert np.array_equal(got, want), kind


def test_rejects_bad_inputs() -> None:
    kernel, n = _kernel(), 4 * QUANT_BLOCK
    segments = (GroupRange(0, 300, 0), GroupRange(512, 100, 0))
    arena = make_arena8(n, segments, torch.bfloat16, None)
    hyper = [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)]

    def step(state: AdamTensors, segs: tuple[GroupRange, ...] = segments, grad: torch.Tensor | None = None) -> None:
        kernel.step(state, arena.grads[0] if grad is None else grad, None, segs, hyper, 1, 1.0)

    def replaced(kind: str, t: torch.Tensor) -> AdamTensors:
        return AdamTensors(arena.state.spec, {**arena.state.tensors, kind: t})

    with pytest.raises(ValueError, match="multiple of 256"):
        step(arena.state, (GroupRange(0, 300, 0), GroupRange(300, 100, 0)))
    with pytest.raises(ValueError, match="exp_avg must be"):
        step(replaced("exp_avg", torch.zeros(n)))
    with pytest.raises(ValueError, match="exp_avg_sq must be"):
        step(replaced("exp_avg_sq", torch.zeros(n, dtype=torch.int8)))
    with pytest.raises(ValueError, match="exp_avg.absmax must be"):
        step(replaced("exp_avg.absmax", torch.zeros(n // QUANT_BLOCK + 1)))
    with pytest.raises(ValueError, match="grad"):
        step(arena.state, grad=torch.zeros(n, dtype=torch.float64))
    with pytest.raises(ValueError, match="segments need"):
        step(arena.state, (GroupRange(768, 300, 0),))


def test_the_entry_point_refuses_what_python_checks() -> None:
    """The C entry's own checks (a caller bypassing check_arenas): -2 for a segment off a block
    boundary, -1 for a dtype code it does not know; nothing is written."""
    n, lib = 2 * QUANT_BLOCK, cpu_adam.load_library("native")
    p, g = torch.zeros(n), torch.ones(n)
    codes, scales = torch.zeros(n, dtype=torch.uint8), torch.zeros(2)
    groups = (cpu_adam._Group * 1)(
        cpu_adam._Group(*step_constants([AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0, True)], 1, 1)[0])
    )
    maps = cpu_adam._maps()

    def call(offset: int, grad_dtype: int) -> int:
        seg = (cpu_adam._Seg * 1)(cpu_adam._Seg(offset, 10, 0))
        ptrs = [t.data_ptr() for t in (p, codes, codes, scales, scales, g)]
        return int(lib.elixir_adam8_step(*ptrs, grad_dtype, None, 3, seg, 1, groups, maps, 1))

    assert call(3, 0) == -2 and call(0, 7) == -1
    assert not p.any() and not codes.any() and not scales.any()
    assert call(0, 0) == 0 and p[:10].ne(0).all() and not p[10:].any()


def test_a_nan_gradient_poisons_its_blocks_as_the_reference() -> None:
    """A NaN in a block's gradient: that block's scales NaN and its codes the code of 0 (quant8:
    x = 0 where the scale is not > 0), as the torch reference; the other blocks are finite."""
    segments, n = make_segments8([1000, 300])
    arena = make_arena8(n, segments, torch.float32, None)
    arena.grads[0][300] = float("nan")
    want = arena.clone()
    TorchAdamKernel().step(want.state, want.grads[0], None, segments, hypers_at(1), 1, 1.0)
    _kernel().step(arena.state, arena.grads[0], None, segments, hypers_at(1), 1, 1.0)
    for kind in KINDS:
        scales = arena.state[f"{kind}.absmax"]
        assert scales[1].isnan() and scales[[0, 2, 4]].isfinite().all(), kind
        assert torch.equal(arena.state[kind], want.state[kind]), kind
