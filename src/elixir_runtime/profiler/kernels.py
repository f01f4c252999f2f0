"""Tracing a GPU step on a machine without a GPU: pick attention kernels as CUDA would.

Fake tensors make every op's output shape known without a device, but
``scaled_dot_product_attention`` chooses its kernel by device: on CPU it may fall back to the
math path (e.g. with dropout), which materialises the ``seq x seq`` scores, where CUDA runs a
fused kernel that saves only the output and a log-sum-exp. Profiling a GPU run on a CPU host
therefore routes the call, for the duration of the trace, to the fused kernel CUDA's dispatcher
would pick (flash for fp16/bf16 without a mask and head dim ≤ 256, else memory-efficient); their
meta kernels give the exact shapes of what they allocate and save.

[Note: fused attention's workspace] A meta kernel returns the op's outputs and nothing else, but
flash attention's backward also allocates, for the length of the call, an fp32 accumulator of the
query gradient (batch x rows rounded up to 128 x heads x head dim rounded up to 32, or 64 above 128)
and the rows' fp32 softmax-gradient dot products: 8 KB a token for 16 heads of 128, one transient
beside the block's recompute. ``workspace_bytes`` prices it; the recorder allocates and frees it
after the op's outputs, so a segment's peak holds it. The memory-efficient kernel (with a mask)
accumulates in its outputs' own buffers and is priced by its meta kernel alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F

__all__ = ["cuda_attention", "workspace_bytes"]

aten = torch.ops.aten


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def workspace_bytes(func: object, args: tuple[object, ...]) -> int:
    """Bytes ``func`` allocates for its own use and frees before it returns (see [Note: fused
    attention's workspace]); 0 for every op but flash attention's backward."""
    if func is not aten._scaled_dot_product_flash_attention_backward.default:
        return 0
    query = args[1]
    assert isinstance(query, torch.Tensor)  # (batch, heads, rows, head dim), SDPA's layout
    batch, heads, rows, dim = query.shape
    rows = _round_up(rows, 128)
    dim = _round_up(dim, 32 if dim <= 128 else 64)
    return 4 * batch * heads * rows * (dim + 1)


def _as_cuda(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if enable_gqa and key.size(-3) != query.size(-3):
            repeat = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        head_dim = query.size(-1)
        if query.dim() != 4 or head_dim > 256 or head_dim % 8:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
            out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)
            return cast(torch.Tensor, out[0])
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf")
            )
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )
        return cast(torch.Tensor, out[0])

    return sdpa


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _as_cuda(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
