"""Fused Adam/AdamW in Triton: one launch updates every segment of a GPU arena.

The grid is a tile table built once per segments tuple: one program per (BLOCK-aligned arena
block, segment) pair, so loads start on BLOCK boundaries and vectorise; a block wholly inside one
segment (almost all of them) runs unmasked, the few at segment edges run masked. Per-group
constants come from a small fp32 table made each step (``adam_consts``), so the kernel does the
same fp32 math as the C++ CPU kernel: one pass reading fp32 p/m/v and the grad, writing p/m/v and
the low-precision param.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..chunk.layout import GroupRange
from .adam_consts import CONST_NAMES, step_constants
from .kernel import AdamHyper, bounded_put, check_arenas, segment_extent

__all__ = ["TritonAdamKernel"]

_NCONST = len(CONST_NAMES)


@triton.jit
def _update(p_ptr, m_ptr, v_ptr, g_ptr, out_ptr, offs, lo, hi, hyp, HAS_OUT: tl.constexpr, MASKED: tl.constexpr):
    """The per-element math, in the order of csrc/cpu_adam.cpp (fma, IEEE sqrt and division);
    with MASKED, only offsets in [lo, hi) are touched."""
    step_size = tl.load(hyp + 0)
    inv_bc2 = tl.load(hyp + 1)
    omb1 = tl.load(hyp + 2)
    beta2 = tl.load(hyp + 3)
    omb2 = tl.load(hyp + 4)
    eps = tl.load(hyp + 5)
    decay_mul = tl.load(hyp + 6)
    l2 = tl.load(hyp + 7)
    grad_mul = tl.load(hyp + 8)
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
    g = g.to(tl.float32) * grad_mul
    p = p * decay_mul
    g = tl.fma(p, l2, g)
    m = tl.fma(omb1, g - m, m)
    v = tl.fma(omb2, g * g, v * beta2)
    denom = tl.fma(tl.sqrt_rn(v), inv_bc2, eps)
    p = tl.fma(-step_size, tl.div_rn(m, denom), p)
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


def build_tiles(segments: Sequence[GroupRange], block: int) -> torch.Tensor:
    """The tile table (int64, shape [4, n_tiles]: block index, lo, hi, group) for ``segments``."""
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


class TritonAdamKernel:
    """AdamKernel for GPU arenas (or CPU tensors under TRITON_INTERPRET=1): one launch a step.

    ``block`` elements per program (a power of two); ``num_warps`` per program.
    """

    def __init__(self, block: int = 1024, num_warps: int = 4) -> None:
        if block & (block - 1) or block < 128:
            raise ValueError("block must be a power of two >= 128")
        self.block, self.num_warps = block, num_warps
        self._tiles: dict[tuple[tuple[GroupRange, ...], torch.device], tuple[torch.Tensor, int, int]] = {}

    def _table(self, segments: Sequence[GroupRange], device: torch.device) -> tuple[torch.Tensor, int, int]:
        """The device tile table, the arena end and the group count it needs; cached per segments."""
        key = (tuple(segments), device)
        hit = self._tiles.get(key)
        if hit is None:
            end, groups = segment_extent(key[0])
            hit = bounded_put(self._tiles, key, (build_tiles(key[0], self.block).to(device), end, groups))
        return hit

    def step(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        segments: Sequence[GroupRange],
        hypers: Sequence[AdamHyper],
        step: int,
        div_scale: float,
    ) -> None:
        """Update all segments in one launch (see ``AdamKernel``)."""
        dev = master.device
        consts = step_constants(hypers, step, div_scale)
        tiles, end, groups = self._table(segments, dev)
        check_arenas(master, exp_avg, exp_avg_sq, grad, param_out, end, groups, len(hypers))
        n_tiles = tiles.shape[1]
        if n_tiles == 0:
            return
        hyp = torch.tensor(consts, dtype=torch.float32).to(dev, non_blocking=True)
        _adam_kernel[(n_tiles,)](
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            master if param_out is None else param_out,
            tiles,
            n_tiles,
            hyp,
            NCONST=_NCONST,
            HAS_OUT=param_out is not None,
            BLOCK=self.block,
            num_warps=self.num_warps,
        )
