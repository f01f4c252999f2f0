"""What one aten op costs: matmul-class FLOPs (by size class), or bytes moved for the rest.

The step-time model is a roofline over these totals (FLOPs at the rate measured for their size
class, bytes at the memory-bound ops' measured rate), so the split follows what the hardware
does: GEMMs and fused attention are compute-bound, the rest (norms, activations, adds, casts, the
loss) streams memory. Views move nothing. A GEMM's size class is its shape (``"8192x1024x4096"``,
``Rates.flop_rate``: [Note: GEMMs by shape]), a batched GEMM's the power of two nearest the
geometric mean of its ``m, n, k``; fused attention's is its number of keys (``"attention:2048"``:
longer sequences fill the kernels' tiles better).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .profile import ATTENTION, gemm_class

__all__ = ["OpCost", "op_cost", "size_class", "CONVOLUTION"]

aten = torch.ops.aten

OpCost = tuple[int, str, int]
"""``(flops, size class, bytes)`` of one op."""

CONVOLUTION = "convolution"


def size_class(m: int, n: int, k: int) -> str:
    """The power of two nearest (in log space) the geometric mean of a GEMM's dimensions."""
    mean = max(1.0, float(m) * n * k) ** (1 / 3)
    return str(2 ** round(math.log2(mean)))


def _mm(args: tuple[torch.Tensor, ...]) -> tuple[int, str]:
    (m, k), n = args[0].shape, args[1].shape[1]
    return 2 * m * k * n, gemm_class(m, n, k)


def _addmm(args: tuple[torch.Tensor, ...]) -> tuple[int, str]:
    return _mm(args[1:])


def _bmm(args: tuple[torch.Tensor, ...]) -> tuple[int, str]:
    (b, m, k), n = args[0].shape, args[1].shape[2]
    return 2 * b * m * k * n, size_class(m, n, k)


def _baddbmm(args: tuple[torch.Tensor, ...]) -> tuple[int, str]:
    return _bmm(args[1:])


_MATMUL: dict[object, Callable[[tuple[torch.Tensor, ...]], tuple[int, str]]] = {  # of the op's tensors
    aten.mm: _mm,
    aten.addmm: _addmm,
    aten.bmm: _bmm,
    aten.baddbmm: _baddbmm,
}


def _attention_flops(
    func: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[int, str] | None:
    """Fused attention (SDPA kernels of every backend): 4·B·H·Sq·Sk·D forward, 2.5× that
    backward (five GEMMs of that size instead of two), halved when causal (the kernels skip the
    masked half); its size class names Sk."""
    name = func.__name__
    if "attention" not in name or not ("scaled_dot_product" in name or name.startswith(("_flash", "_efficient"))):
        return None
    backward = "backward" in name
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return None
    batch, heads, sq, dim = q.shape
    sk: int = k.shape[-2]
    flops = 4 * batch * heads * sq * sk * dim
    if backward:
        flops = flops * 5 // 2
    if _argument(func, args, kwargs, "is_causal"):
        flops //= 2
    return flops, f"{ATTENTION}:{sk}"


def _argument(func: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object], name: str) -> object:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) else arg.default_value
    return None


_NO_TRAFFIC = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
    aten.lift_fresh,
}
"""Ops that allocate or relabel without touching memory (``is_view`` misses these)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_cost(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],  # as the dispatcher passes them: a matmul's are its tensors
    kwargs: dict[str, object],
    inputs: list[object],
    outputs: list[object],
) -> OpCost:
    """``inputs``/``outputs`` are the flattened args and results (tensors among other leaves)."""
    if func.is_view:
        return 0, "", 0
    packet = func.overloadpacket
    matmul = _MATMUL.get(packet)
    if matmul is not None:
        flops, cls = matmul(args)
        return flops, cls, 0
    attention = _attention_flops(func, args, kwargs)
    if attention is not None:
        return *attention, 0
    if packet in flop_registry:  # convolutions
        try:
            out = outputs[0] if len(outputs) == 1 else tuple(outputs)
            return int(flop_registry[packet](*args, **kwargs, out_val=out)), CONVOLUTION, 0
        except Exception:  # an unusual overload of a registered op: count its bytes instead
            pass
    written = [t for t in outputs if isinstance(t, torch.Tensor)]
    if not written or packet in _NO_TRAFFIC:  # metadata queries (prim.device, sym sizes) and allocations
        return 0, "", 0
    moved = sum(_nbytes(t) for t in inputs if isinstance(t, torch.Tensor)) + sum(_nbytes(t) for t in written)
    return 0, "", moved
