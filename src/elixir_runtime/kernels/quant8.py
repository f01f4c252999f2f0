"""Block-wise dynamic 8-bit quantization of Adam's moments ([Note: 8-bit moments], ``adam_state.py``).

The one definition of the format, which the kernels, the checkpoint and ``elixir-convert`` share:

* ``CODEBOOK[kind]``: the 256 values a code stands for, ascending in [-1, 1] (``exp_avg``, signed) or
  [0, 1] (``exp_avg_sq``): 0, 1 and, for each decade 1e-6..1, evenly spaced values inside it (2^i
  per sign in decade i for the signed map, 2^(i+1) for the unsigned one);
* a block's scale is the largest magnitude of its values, a value's code the index of the codebook
  entry nearest to value / scale (a tie goes to the lower index), a block of zeros scale 0 and code
  ``ZERO[kind]``; a value reads back as ``CODEBOOK[code] * scale``.

[Note: nearest code by bucket]
The fused kernels find the nearest entry without a search: the top 16 bits of ``x = value / scale``
(sign, exponent, 7 mantissa bits) index ``BUCKET``, the number of midpoints between neighbouring
entries below that bucket of floats; one more comparison with the next midpoint gives the code.
This is exact because no bucket holds two midpoints (checked when the tables are built: a bucket
spans 1/128 of its power of two, the entries of a decade are at least 1/64 of the decade apart).
The same fp32 division and comparisons run in C++, in Triton and here, so all three give the same
codes from the same moments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from ..adam_state import ADAM_STATE, QUANT_BLOCK, AdamState

__all__ = [
    "QuantTables",
    "tables",
    "codebook",
    "quantize",
    "dequantize",
    "decode_state",
    "encode_state",
    "MOMENT_KINDS",
]

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
"""The quantized moments; ``exp_avg`` has the signed map."""
_EXPONENTS = 7


def codebook(signed: bool) -> np.ndarray:
    """The 256 fp32 values of the dynamic map, ascending."""
    values = [0.0, 1.0]
    for i in range(_EXPONENTS):
        n = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, n + 1)
        means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - _EXPONENTS + 1)
        values += means.tolist() + ((-means).tolist() if signed else [])
    assert len(values) == 256, len(values)
    return np.sort(np.array(values, dtype=np.float32))


def _buckets(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mid, bucket)``: the 255 midpoints (+inf last) and, per top-16-bit pattern of an fp32 value,
    the number of midpoints below its bucket; raises where a bucket holds two midpoints."""
    mid = np.append((code[:-1].astype(np.float64) + code[1:]) / 2, np.inf).astype(np.float32)
    keys = np.arange(2**16, dtype=np.uint32)
    ends = np.stack([keys << 16, (keys << 16) | 0xFFFF]).view(np.float32)  # each bucket's two ends
    low, high = np.minimum(ends[0], ends[1]), np.maximum(ends[0], ends[1])  # NaN patterns stay NaN
    finite = np.isfinite(low) & np.isfinite(high)
    low, high = np.where(finite, low, np.float32(-np.inf)), np.where(finite, high, np.float32(-np.inf))
    base = np.searchsorted(mid, low, side="left")  # midpoints < low
    inside = np.searchsorted(mid, high, side="right") - base  # midpoints in [low, high]
    if (inside > 1).any():
        raise AssertionError("a bucket of fp32 values holds two midpoints of the 8-bit map")
    return mid, np.minimum(base, 255).astype(np.uint8)


@dataclass(frozen=True, eq=False)
class QuantTables:
    """One moment's map on one device: ``code`` (256 fp32), ``mid`` (256 fp32), ``bucket`` (65536 uint8)."""

    code: torch.Tensor
    mid: torch.Tensor
    bucket: torch.Tensor
    zero: int
    """The code of 0.0."""


@cache
def _host_tables(kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if kind not in MOMENT_KINDS:
        raise ValueError(f"no 8-bit map for {kind!r}: the quantized moments are {MOMENT_KINDS}")
    code = codebook(signed=kind == "exp_avg")
    assert code[ADAM_STATE["8bit"].tensor(kind).zero] == 0.0, "adam_state's zero code is the map's"
    return (code, *_buckets(code))


_DEVICE: dict[tuple[str, torch.device], QuantTables] = {}


def tables(kind: str, device: torch.device | str = "cpu") -> QuantTables:
    """The map of moment ``kind`` as tensors on ``device`` (made once per device)."""
    device = torch.device(device)
    hit = _DEVICE.get((kind, device))
    if hit is None:
        code, mid, bucket = _host_tables(kind)
        hit = _DEVICE[(kind, device)] = QuantTables(
            torch.from_numpy(code).to(device),
            torch.from_numpy(mid).to(device),
            torch.from_numpy(bucket).to(device),
            int(np.flatnonzero(code == 0.0)[0]),
        )
    return hit


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) zero-padded to whole blocks, as ``[blocks, QUANT_BLOCK]``."""
    pad = -x.numel() % QUANT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


def quantize(kind: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8, scales fp32)`` of the fp32 ``values`` (1-D, blocks from element 0)."""
    t = tables(kind, values.device)
    blocks = _blocks(values.to(torch.float32))
    scale = blocks.abs().amax(dim=1)
    x = torch.where(scale[:, None] > 0, blocks / torch.where(scale > 0, scale, 1.0)[:, None], 0.0)
    key = (x.view(torch.int32) >> 16) & 0xFFFF
    base = t.bucket[key.long()].long()
    codes = base + (x > t.mid[base]).long()
    return codes.to(torch.uint8).reshape(-1)[: values.numel()], scale


def dequantize(kind: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``codes`` (1-D, blocks from element 0) stand for under ``scales``."""
    t = tables(kind, codes.device)
    n = codes.numel()
    per = scales.repeat_interleave(QUANT_BLOCK)[:n]
    return t.code[codes.long()] * per


def decode_state(state: AdamState, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (one piece of each kind of ``state``, blocks from its first element; ``None`` for a
    kind a reader keeps) as exact state: ``master`` as it is, the moments in fp32."""
    if not state.quantized:
        return dict(tensors)
    out = {"master": tensors["master"]} if "master" in tensors else {}
    for kind in MOMENT_KINDS:
        out[kind] = dequantize(kind, tensors[kind], tensors[f"{kind}.absmax"])
    return out


def encode_state(state: AdamState, exact: dict[str, Any]) -> dict[str, Any]:
    """Exact state (``decode_state``'s form) stored as ``state``'s kinds."""
    if not state.quantized:
        return exact
    out = {"master": exact["master"]}
    for kind in MOMENT_KINDS:
        value = exact[kind]
        assert value is not None, "a reader gives every moment"
        out[kind], out[f"{kind}.absmax"] = quantize(kind, value.to(torch.float32))
    return out
