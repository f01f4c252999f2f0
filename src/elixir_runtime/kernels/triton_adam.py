"""Fused Adam/AdamW in Triton: one launch updates every segment of a GPU arena.

Exact (fp32) moments: the grid is a tile table built once per segments tuple, one program per
(BLOCK-aligned arena block, segment) pair, so loads start on BLOCK boundaries and vectorise; a block
wholly inside one segment (almost all of them) runs unmasked, the few at segment edges run masked.

8-bit moments ([Note: 8-bit moments], ``adam_state.py``): tiles lie on each segment's own grid
(segments start a quantization block), so a tile holds whole quantization blocks of one segment and
finds each block's new scale by itself; see [Note: the 8-bit tile].

Per-group constants come from a small fp32 table made each step (``adam_consts``), so the kernel
does the same fp32 math as the C++ CPU kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..adam_state import QUANT_BLOCK, AdamTensors
from ..chunk.layout import GroupRange
from . import quant8
from .adam_consts import CONST_NAMES, step_constants
from .kernel import AdamHyper, bounded_put, check_arenas, segment_extent

__all__ = ["TritonAdamKernel", "build_tiles", "build_tiles8"]

_NCONST = len(CONST_NAMES)


@triton.jit
def _adam_math(p, m, v, g, hyp):
    """New (p, m, v) from fp32 p, m, v and the raw grad: the order of csrc/cpu_adam.cpp (fma,
    IEEE sqrt and division), with the group's constants at ``hyp``."""
    step_size = tl.load(hyp + 0)
    inv_bc2 = tl.load(hyp + 1)
    omb1 = tl.load(hyp + 2)
    beta2 = tl.load(hyp + 3)
    omb2 = tl.load(hyp + 4)
    eps = tl.load(hyp + 5)
    decay_mul = tl.load(hyp + 6)
    l2 = tl.load(hyp + 7)
    grad_mul = tl.load(hyp + 8)
    g = g.to(tl.float32) * grad_mul
    p = p * decay_mul
    g = tl.fma(p, l2, g)
    m = tl.fma(omb1, g - m, m)
    v = tl.fma(omb2, g * g, v * beta2)
    denom = tl.fma(tl.sqrt_rn(v), inv_bc2, eps)
    p = tl.fma(-step_size, tl.div_rn(m, denom), p)
    return p, m, v


@triton.jit
def _update(p_ptr, m_ptr, v_ptr, g_ptr, out_ptr, offs, lo, hi, hyp, HAS_OUT: tl.constexpr, MASKED: tl.constexpr):
    """One fp32-state tile; with MASKED, only offsets in [lo, hi) are touched."""
    mask = (offs >= lo) & (offs < hi)
    if MASKED:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    else:
        g = tl.load(g_ptr + offs)
        p = tl.load(p_ptr + offs)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    p, m, v = _adam_math(p, m, v, g, hyp)
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty))


@triton.jit
def _adam_kernel(
    p_ptr,
    m_ptr,
    v_ptr,
    g_ptr,
    out_ptr,
    tiles_ptr,
    n_tiles,
    hyp_ptr,
    NCONST: tl.constexpr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program t updates tile t: rows of ``tiles`` are (block index, lo, hi, group)."""
    t = tl.program_id(0)
    blk = tl.load(tiles_ptr + t)
    lo = tl.load(tiles_ptr + n_tiles + t)
    hi = tl.load(tiles_ptr + 2 * n_tiles + t)
    group = tl.load(tiles_ptr + 3 * n_tiles + t)
    base = blk * BLOCK
    offs = base + tl.arange(0, BLOCK)
    hyp = hyp_ptr + group * NCONST
    if (lo == base) & (hi == base + BLOCK):
        _update(p_ptr, m_ptr, v_ptr, g_ptr, out_ptr, offs, lo, hi, hyp, HAS_OUT, False)
    else:
        _update(p_ptr, m_ptr, v_ptr, g_ptr, out_ptr, offs, lo, hi, hyp, HAS_OUT, True)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


# tl.max's own combine, by identity: tl.max is a jit function of triton.language, which the
# interpreter cannot call where triton was imported before TRITON_INTERPRET=1 was set (the tests
# load this module's copy later), but it reduces with numpy when it sees this combine.
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _larger)


# [Note: the 8-bit tile]
# A tile is [BLOCK // QB, QB]: row j is quantization block ``qblk + j`` of one segment, whose
# elements past the segment's end (``hi``) are zero padding, never read as moments nor written.
# Per element: codes and the row's scale give m = CODE[c] * scale (as quant8.dequantize), then
# exactly _adam_math's fp32 ops. Per row: the new scale is max |m| over the row (padding counts
# 0), x = div_rn(m, scale) (0 where the scale is 0), and the code is bucket[top 16 bits of x]
# plus (x > mid[that code]) ([Note: nearest code by bucket], quant8.py): the same fp32 division
# and comparison as quant8.quantize, so the same codes from the same fp32 moments. Only rows with
# an element below ``hi`` store their scale. The tables (1 KiB fp32 codebooks and midpoints, 64
# KiB buckets per moment) are read by gathers that stay in L1/L2: six per element, against about
# 16 bytes of DRAM traffic (28 for fp32 state); where benchmarks/adam8_rate.py finds the 8-bit
# update slower than the fp32 one, the bucket gathers (random lines of 64 KiB) are the suspect.
@triton.jit
def _quantize(value, bucket_ptr, mid_ptr):
    """(codes uint8, scales) of ``value`` ([rows, QB] fp32, padding 0): one scale per row."""
    scale = tl.reduce(tl.abs(value), 1, _MAX_COMBINE)
    live = scale > 0.0
    x = tl.where(live[:, None], tl.div_rn(value, tl.where(live, scale, 1.0)[:, None]), 0.0)
    key = (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    code = tl.load(bucket_ptr + key).to(tl.int32)
    code += (x > tl.load(mid_ptr + code)).to(tl.int32)
    return code.to(tl.uint8), scale


@triton.jit
def _update8(
    p_ptr,
    m_ptr,
    v_ptr,
    ms_ptr,
    vs_ptr,
    g_ptr,
    out_ptr,
    qblk,
    hi,
    hyp,
    m_code_ptr,
    m_mid_ptr,
    m_bucket_ptr,
    v_code_ptr,
    v_mid_ptr,
    v_bucket_ptr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    QB: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One 8-bit tile ([Note: the 8-bit tile]); with MASKED, only elements below ``hi`` and rows
    holding one are touched."""
    start = qblk * QB
    rows = tl.arange(0, BLOCK // QB)
    offs = start + rows[:, None] * QB + tl.arange(0, QB)[None, :]
    sidx = qblk + rows
    mask = offs < hi
    smask = start + rows * QB < hi
    if MASKED:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        mc = tl.load(m_ptr + offs, mask=mask, other=0)
        vc = tl.load(v_ptr + offs, mask=mask, other=0)
        ms = tl.load(ms_ptr + sidx, mask=smask, other=0.0)
        vs = tl.load(vs_ptr + sidx, mask=smask, other=0.0)
    else:
        g = tl.load(g_ptr + offs)
        p = tl.load(p_ptr + offs)
        mc = tl.load(m_ptr + offs)
        vc = tl.load(v_ptr + offs)
        ms = tl.load(ms_ptr + sidx)
        vs = tl.load(vs_ptr + sidx)
    m = tl.load(m_code_ptr + mc.to(tl.int32)) * ms[:, None]
    v = tl.load(v_code_ptr + vc.to(tl.int32)) * vs[:, None]
    if MASKED:  # padding reads as 0 (a code's value times a live row's scale otherwise): stays 0
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
    p, m, v = _adam_math(p, m, v, g, hyp)
    mc, ms = _quantize(m, m_bucket_ptr, m_mid_ptr)
    vc, vs = _quantize(v, v_bucket_ptr, v_mid_ptr)
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, mc, mask=mask)
        tl.store(v_ptr + offs, vc, mask=mask)
        tl.store(ms_ptr + sidx, ms, mask=smask)
        tl.store(vs_ptr + sidx, vs, mask=smask)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, mc)
        tl.store(v_ptr + offs, vc)
        tl.store(ms_ptr + sidx, ms)
        tl.store(vs_ptr + sidx, vs)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty))


@triton.jit
def _adam8_kernel(
    p_ptr,
    m_ptr,
    v_ptr,
    ms_ptr,
    vs_ptr,
    g_ptr,
    out_ptr,
    tiles_ptr,
    n_tiles,
    hyp_ptr,
    m_code_ptr,
    m_mid_ptr,
    m_bucket_ptr,
    v_code_ptr,
    v_mid_ptr,
    v_bucket_ptr,
    NCONST: tl.constexpr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    QB: tl.constexpr,
):
    """Program t updates tile t of the 8-bit state: rows of ``tiles`` are (first quantization
    block, hi, group); a tile reaching ``hi`` at its end (all but a segment's last) runs unmasked."""
    t = tl.program_id(0)
    qblk = tl.load(tiles_ptr + t)
    hi = tl.load(tiles_ptr + n_tiles + t)
    group = tl.load(tiles_ptr + 2 * n_tiles + t)
    hyp = hyp_ptr + group * NCONST
    if hi - qblk * QB == BLOCK:
        _update8(
            p_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, g_ptr, out_ptr, qblk, hi, hyp,
            m_code_ptr, m_mid_ptr, m_bucket_ptr, v_code_ptr, v_mid_ptr, v_bucket_ptr,
            HAS_OUT, BLOCK, QB, False,
        )  # fmt: skip
    else:
        _update8(
            p_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, g_ptr, out_ptr, qblk, hi, hyp,
            m_code_ptr, m_mid_ptr, m_bucket_ptr, v_code_ptr, v_mid_ptr, v_bucket_ptr,
            HAS_OUT, BLOCK, QB, True,
        )  # fmt: skip


def build_tiles(segments: Sequence[GroupRange], block: int) -> torch.Tensor:
    """The fp32 tile table (int64, shape [4, n_tiles]: block index, lo, hi, group) for ``segments``."""
    rows = []
    for s in segments:
        if s.length <= 0:
            continue
        end = s.offset + s.length
        blk = torch.arange(s.offset // block, (end - 1) // block + 1, dtype=torch.int64)
        lo = torch.clamp(blk * block, min=s.offset)
        hi = torch.clamp((blk + 1) * block, max=end)
        rows.append(torch.stack([blk, lo, hi, torch.full_like(blk, s.group)]))
    return torch.cat(rows, dim=1) if rows else torch.zeros(4, 0, dtype=torch.int64)


def build_tiles8(segments: Sequence[GroupRange], block: int) -> torch.Tensor:
    """The 8-bit tile table (int64, shape [3, n_tiles]: first quantization block, hi, group):
    tile k of a segment starts at ``offset + k * block`` (``offset`` a multiple of QUANT_BLOCK,
    checked by ``check_arenas``) and ends at ``min(start + block, end)``."""
    rows = []
    for s in segments:
        if s.length <= 0:
            continue
        end = s.offset + s.length
        start = torch.arange(s.offset, end, block, dtype=torch.int64)
        hi = torch.clamp(start + block, max=end)
        rows.append(torch.stack([start // QUANT_BLOCK, hi, torch.full_like(start, s.group)]))
    return torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.int64)


def _power_of_two(n: int, least: int) -> bool:
    return n >= least and not n & (n - 1)


class TritonAdamKernel:
    """AdamKernel for GPU arenas (or CPU tensors under TRITON_INTERPRET=1): one launch a step.

    ``block`` elements per program (a power of two >= 128) and ``num_warps`` per program for the
    fp32 state; ``block8`` (a power of two >= QUANT_BLOCK) and ``num_warps8`` for the 8-bit one
    (the defaults: the fastest of ``benchmarks.adam8_rate``'s sweep on an H200, docs/kernels.md).
    """

    def __init__(self, block: int = 1024, num_warps: int = 4, block8: int = 512, num_warps8: int = 4) -> None:
        if not _power_of_two(block, 128):
            raise ValueError(f"block must be a power of two >= 128, not {block}")
        if not _power_of_two(block8, QUANT_BLOCK):
            raise ValueError(f"block8 must be a power of two >= {QUANT_BLOCK}, not {block8}")
        self.block, self.num_warps = block, num_warps
        self.block8, self.num_warps8 = block8, num_warps8
        self._tiles: dict[tuple[tuple[GroupRange, ...], torch.device, bool], tuple[torch.Tensor, int, int]] = {}

    def _table(
        self, segments: Sequence[GroupRange], device: torch.device, quantized: bool
    ) -> tuple[torch.Tensor, int, int]:
        """The device tile table, the arena end and the group count it needs; cached per segments."""
        key = (tuple(segments), device, quantized)
        hit = self._tiles.get(key)
        if hit is None:
            end, groups = segment_extent(key[0])
            tiles = build_tiles8(key[0], self.block8) if quantized else build_tiles(key[0], self.block)
            hit = bounded_put(self._tiles, key, (tiles.to(device), end, groups))
        return hit

    def step(
        self,
        state: AdamTensors,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        segments: Sequence[GroupRange],
        hypers: Sequence[AdamHyper],
        step: int,
        div_scale: float,
    ) -> None:
        """Update all segments in one launch (see ``AdamKernel``)."""
        master = state.master
        dev = master.device
        consts = step_constants(hypers, step, div_scale)
        quantized = state.spec.quantized
        if quantized and state.spec.alignment != QUANT_BLOCK:
            raise ValueError(f"the 8-bit kernel quantizes blocks of {QUANT_BLOCK}, not {state.spec.alignment}")
        tiles, end, groups = self._table(segments, dev, quantized)
        check_arenas(state, grad, param_out, segments, end, groups, len(hypers))
        n_tiles = tiles.shape[1]
        if n_tiles == 0:
            return
        hyp = torch.tensor(consts, dtype=torch.float32).to(dev, non_blocking=True)
        out = master if param_out is None else param_out
        if not quantized:
            _adam_kernel[(n_tiles,)](
                master,
                state["exp_avg"],
                state["exp_avg_sq"],
                grad,
                out,
                tiles,
                n_tiles,
                hyp,
                NCONST=_NCONST,
                HAS_OUT=param_out is not None,
                BLOCK=self.block,
                num_warps=self.num_warps,
            )
            return
        mt, vt = quant8.tables("exp_avg", dev), quant8.tables("exp_avg_sq", dev)
        _adam8_kernel[(n_tiles,)](
            master,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["exp_avg.absmax"],
            state["exp_avg_sq.absmax"],
            grad,
            out,
            tiles,
            n_tiles,
            hyp,
            mt.code,
            mt.mid,
            mt.bucket,
            vt.code,
            vt.mid,
            vt.bucket,
            NCONST=_NCONST,
            HAS_OUT=param_out is not None,
            BLOCK=self.block8,
            QB=QUANT_BLOCK,
            num_warps=self.num_warps8,
        )
