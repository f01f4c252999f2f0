"""The one interface every Adam kernel implements, and the torch reference behind it.

The chunk optimizer keeps each placement's shards (on-device or offloaded) in flat arenas:
the optimizer state of ``adam_state.py`` (fp32 master and the moments, exact or 8-bit), a
low-precision (or fp32) grad and the compute-dtype param copy.
A static list of :class:`GroupRange` s says which arena range belongs to which param group, so a
kernel updates a whole placement in one call with no per-parameter Python work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ..adam_state import AdamTensors
from ..chunk.layout import GroupRange
from . import quant8

__all__ = ["AdamHyper", "AdamKernel", "TorchAdamKernel", "segment_extent", "check_arenas", "bounded_put"]


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """Hyperparameters of one param group at one step (read from ``param_groups`` each step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    """True for AdamW (decay applied to the weight), False for Adam (L2 added to the grad)."""


def segment_extent(segments: Sequence[GroupRange]) -> tuple[int, int]:
    """``(end of the last segment, number of groups)`` after checking the segments are well formed."""
    if any(s.offset < 0 or s.length < 0 or s.group < 0 for s in segments):
        raise ValueError("segments need non-negative offsets, lengths and groups")
    end = max((s.offset + s.length for s in segments), default=0)
    groups = max((s.group + 1 for s in segments), default=0)
    return end, groups


TABLE_CACHE = 64
"""Segment tables a fused kernel keeps. A placement's list is static while every parameter gets a
gradient; parameters without one make other lists (one per set of used parameters), which a
model with data-dependent routing could multiply without bound."""


_K = TypeVar("_K")
_V = TypeVar("_V")


def bounded_put(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    """``cache[key] = value``, first dropping the oldest entry of a full cache; returns ``value``."""
    if len(cache) >= TABLE_CACHE:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


_GRAD = (torch.float32, torch.bfloat16, torch.float16)
_OUT = (torch.bfloat16, torch.float16)


def check_arenas(
    state: AdamTensors,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    segments: Sequence[GroupRange],
    end: int,
    groups: int,
    n_hypers: int,
) -> None:
    """What the fused kernels assume of their arenas (they take raw pointers / flat offsets):
    contiguous, element-aligned, on ``master``'s device, each state tensor of its kind's dtype and
    size (``adam_state.py``), a fp32/bf16/fp16 grad and a bf16/fp16 ``param_out`` (or none) of
    ``master``'s size, and segments (``end``, ``groups`` from ``segment_extent``) that fit the arena
    and the hyperparameters; with quantized moments every segment starts a block
    ([Note: 8-bit moments]: a block is then updated by one segment, the rest of it zero padding)."""
    master = state.master
    n, dev = master.numel(), master.device
    arenas: list[tuple[str, torch.Tensor, tuple[torch.dtype, ...], int]]
    arenas = [(t.kind, x, (t.dtype,), t.entries(n)) for t, x in state.items()]
    arenas += [("grad", grad, _GRAD, n)] + ([("param_out", param_out, _OUT, n)] if param_out is not None else [])
    for name, t, dtypes, size in arenas:
        if (
            t.dtype not in dtypes
            or t.device != dev
            or not t.is_contiguous()
            or t.numel() != size
            or (t.data_ptr() % t.element_size())
        ):
            kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} must be a contiguous, element-aligned {kinds} tensor of {size} elements on {dev}")
    if end > n or groups > n_hypers:
        raise ValueError(f"segments need {end} elements and {groups} groups; got {n} and {n_hypers}")
    block = state.spec.alignment
    if block > 1 and any(s.offset % block for s in segments):
        raise ValueError(f"with {state.spec.moments} moments every segment must start at a multiple of {block}")


class AdamKernel(Protocol):
    """Updates ``state`` (master and moments, ``adam_state.AdamTensors``) in place and writes the
    new params into ``param_out``.

    ``grad`` is divided by ``div_scale`` first (loss-scale unscaling and clipping fused);
    ``step`` is the 1-based step number used for bias correction. ``param_out`` is ``None``
    where there is no compute-dtype copy to keep: the master *is* the param (fp32), or gathers cast
    the master (on-device shards in mixed precision, ``chunk/store.py``). Quantized moments are read
    back, updated in fp32 with the same math as exact ones, and stored with each block's new scale.
    """

    def step(
        self,
        state: AdamTensors,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        segments: Sequence[GroupRange],
        hypers: Sequence[AdamHyper],
        step: int,
        div_scale: float,
    ) -> None: ...


class TorchAdamKernel:
    """Plain torch ops, the same math and order as ``torch.optim.AdamW``'s single-tensor path.

    The reference and the fallback: correct on any device, slow (one pass per op per segment).
    Quantized moments go through ``quant8``'s ``dequantize``/``quantize``, a segment at a time.
    """

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
        quantized = state.spec.quantized
        for seg in segments:
            h = hypers[seg.group]
            lo, hi = seg.offset, seg.offset + seg.length
            part = state.range(lo, hi)
            p = part.master[: seg.length]
            if quantized:
                m = quant8.dequantize("exp_avg", part["exp_avg"][: seg.length], part["exp_avg.absmax"])
                v = quant8.dequantize("exp_avg_sq", part["exp_avg_sq"][: seg.length], part["exp_avg_sq.absmax"])
            else:
                m, v = part["exp_avg"], part["exp_avg_sq"]
            g = grad[lo:hi].to(torch.float32)
            if div_scale != 1.0:
                g = g / div_scale
            if h.weight_decay != 0.0:
                if h.decoupled:
                    p.mul_(1.0 - h.lr * h.weight_decay)
                else:
                    g = g.add(p, alpha=h.weight_decay)
            m.lerp_(g, 1.0 - h.beta1)
            v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
            bias_correction1 = 1.0 - h.beta1**step
            bias_correction2_sqrt = (1.0 - h.beta2**step) ** 0.5
            denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps)
            p.addcdiv_(m, denom, value=-h.lr / bias_correction1)
            if quantized:
                for kind, value in (("exp_avg", m), ("exp_avg_sq", v)):
                    codes, scales = quant8.quantize(kind, value)
                    part[kind][: seg.length].copy_(codes)
                    part[f"{kind}.absmax"].copy_(scales)
            if param_out is not None:
                param_out[lo:hi].copy_(p)
