"""Shared Adam test cases: arenas with odd segments, four kinds of group, and a float64 reference.

The reference is ``torch.optim.AdamW`` (decoupled groups) and ``torch.optim.Adam`` (L2 groups) in
float64, one parameter per segment, fed the same low-precision grads divided by ``div_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elixir_runtime.adam_state import ADAM_STATE, QUANT_BLOCK, AdamTensors
from elixir_runtime.chunk.layout import GroupRange, round_up
from elixir_runtime.kernels.kernel import AdamHyper

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, None)
DIV_SCALES = (1.0, 1024.0, 3.7, 0.5)
"""One per step: loss-scale unscaling (powers of two) and clipping coefficients (anything)."""

# Tolerances against the float64 reference after len(DIV_SCALES) steps (the fp32 rounding of a
# few ops per step; torch's own fp32 AdamW lands well inside them too).
MASTER_TOL = dict(rtol=1e-5, atol=1e-6)
EXP_AVG_TOL = dict(rtol=1e-5, atol=1e-7)
EXP_AVG_SQ_TOL = dict(rtol=1e-5, atol=1e-10)

_BASE = (  # (lr, beta1, beta2, eps, weight_decay, decoupled): AdamW/Adam x decay on/off
    (1e-2, 0.9, 0.999, 1e-8, 0.1, True),
    (3e-3, 0.8, 0.99, 1e-6, 0.0, True),
    (5e-3, 0.9, 0.995, 1e-8, 0.05, False),
    (2e-3, 0.85, 0.999, 1e-7, 0.0, False),
)


def hypers_at(step: int) -> list[AdamHyper]:
    """The four groups' hyperparameters at 1-based ``step``: the lr changes every step."""
    scale = 1.0 + 0.5 * math.sin(step)
    return [AdamHyper(lr * scale, b1, b2, eps, wd, dec) for lr, b1, b2, eps, wd, dec in _BASE]


def make_segments(lengths: list[int], gap: int = 5) -> tuple[tuple[GroupRange, ...], int]:
    """Segments of ``lengths`` cycling through the groups, with ``gap`` untouched elements between
    some of them (as padding in a real arena); returns them and the arena size."""
    segs, offset = [], 0
    for i, n in enumerate(lengths):
        segs.append(GroupRange(offset, n, i % len(_BASE)))
        offset += n + (gap if i % 2 else 0)
    return tuple(segs), offset + gap


@dataclass
class Arena:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: list[torch.Tensor]
    """One (scaled, low-precision) grad per step."""
    out: torch.Tensor | None

    def clone(self) -> Arena:
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return Arena(c(self.master), c(self.exp_avg), c(self.exp_avg_sq), [g.clone() for g in self.grads], c(self.out))

    def state(self) -> AdamTensors:
        """The arena's exact (fp32) optimizer state, as the kernels take it."""
        return AdamTensors(
            ADAM_STATE["fp32"], {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        )

    def to(self, device: str) -> Arena:
        t = lambda x: None if x is None else x.to(device)  # noqa: E731
        return Arena(t(self.master), t(self.exp_avg), t(self.exp_avg_sq), [t(g) for g in self.grads], t(self.out))


def make_arena(numel: int, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int = 0) -> Arena:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    grads = [(torch.randn(numel, generator=gen) * s).to(grad_dtype) for s in DIV_SCALES]
    out = None if out_dtype is None else torch.full((numel,), 7.0, dtype=out_dtype)  # sentinel for gaps
    return Arena(master, torch.zeros(numel), torch.zeros(numel), grads, out)


def run_kernel(kernel, arena: Arena, segments: tuple[GroupRange, ...]) -> None:
    """All steps of the case through ``kernel`` (an AdamKernel), in place."""
    for step, (grad, div) in enumerate(zip(arena.grads, DIV_SCALES), start=1):
        kernel.step(arena.state(), grad, arena.out, segments, hypers_at(step), step, div)


def run_torch_adam(
    arena: Arena,
    segments: tuple[GroupRange, ...],
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """master, exp_avg, exp_avg_sq (on the CPU) after all steps of torch.optim.AdamW (decoupled
    groups) and torch.optim.Adam (L2 groups) in ``dtype`` on ``device``, one parameter per segment."""
    params = [torch.nn.Parameter(arena.master[s.offset : s.offset + s.length].to(device, dtype)) for s in segments]
    opts = []
    for decoupled, cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        groups = [
            dict(params=ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, gi=gi)
            for gi, (lr, b1, b2, eps, wd, dec) in enumerate(_BASE)
            if dec == decoupled and (ps := [p for p, s in zip(params, segments) if s.group == gi])
        ]
        if groups:
            opts.append(cls(groups, fused=True) if fused else cls(groups, foreach=False))
    for step, (grad, div) in enumerate(zip(arena.grads, DIV_SCALES), start=1):
        hypers = hypers_at(step)
        for p, s in zip(params, segments):
            p.grad = grad[s.offset : s.offset + s.length].to(device, dtype) / div
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = hypers[group["gi"]].lr
            opt.step()
    state = {p: st for opt in opts for p, st in opt.state.items()}
    master = arena.master.to("cpu", dtype)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    for p, s in zip(params, segments):
        sl = slice(s.offset, s.offset + s.length)
        master[sl] = p.detach().cpu()
        exp_avg[sl] = state[p]["exp_avg"].cpu()
        exp_avg_sq[sl] = state[p]["exp_avg_sq"].cpu()
    return master, exp_avg, exp_avg_sq


def covered_mask(segments: tuple[GroupRange, ...], numel: int) -> torch.Tensor:
    covered = torch.zeros(numel, dtype=torch.bool)
    for s in segments:
        covered[s.offset : s.offset + s.length] = True
    return covered


def check_against_reference(result: Arena, start: Arena, segments: tuple[GroupRange, ...], out_ulps: int = 0) -> None:
    """``result`` (after run_kernel on a clone of ``start``) matches the float64 reference; the
    low-precision copy is the new master rounded to nearest even (within ``out_ulps`` units in the
    last place: Triton's interpreter truncates to bf16); elements outside segments are untouched."""
    master, exp_avg, exp_avg_sq = run_torch_adam(start, segments)
    covered = covered_mask(segments, master.numel())
    got = result.to("cpu")
    torch.testing.assert_close(got.master[covered].double(), master[covered], **MASTER_TOL)
    torch.testing.assert_close(got.exp_avg[covered].double(), exp_avg[covered], **EXP_AVG_TOL)
    torch.testing.assert_close(got.exp_avg_sq[covered].double(), exp_avg_sq[covered], **EXP_AVG_SQ_TOL)
    assert torch.equal(got.master[~covered], start.master[~covered])
    if got.out is not None:
        expected, rtol = got.master[covered].to(got.out.dtype), out_ulps * torch.finfo(got.out.dtype).eps
        torch.testing.assert_close(got.out[covered].float(), expected.float(), rtol=rtol, atol=0)
        assert torch.equal(got.out[~covered], start.out[~covered])


# ---------------------------------------------------------------- 8-bit moments
def make_segments8(lengths: list[int]) -> tuple[tuple[GroupRange, ...], int]:
    """Segments of ``lengths`` cycling through the groups, each starting a quantization block (as the
    layout places parameters), zero padding to the next block, and a whole untouched block after
    some of them; returns them and the arena size."""
    segs, offset = [], 0
    for i, n in enumerate(lengths):
        segs.append(GroupRange(offset, n, i % len(_BASE)))
        offset = round_up(offset + n, QUANT_BLOCK) + (QUANT_BLOCK if i % 3 == 2 else 0)
    return tuple(segs), offset + QUANT_BLOCK


@dataclass
class Arena8:
    state: AdamTensors
    grads: list[torch.Tensor]
    out: torch.Tensor | None

    def clone(self) -> Arena8:
        return Arena8(
            AdamTensors(self.state.spec, {k: t.clone() for k, t in self.state.tensors.items()}),
            [g.clone() for g in self.grads],
            None if self.out is None else self.out.clone(),
        )

    def to(self, device: str) -> Arena8:
        return Arena8(
            AdamTensors(self.state.spec, {k: t.to(device) for k, t in self.state.tensors.items()}),
            [g.to(device) for g in self.grads],
            None if self.out is None else self.out.to(device),
        )


def make_arena8(
    numel: int, segments: tuple[GroupRange, ...], grad_dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int = 0
) -> Arena8:
    """An 8-bit state at step 0 (zero moments) whose padding (outside ``segments``) is zero, as the engine's."""
    gen = torch.Generator().manual_seed(seed)
    covered = covered_mask(segments, numel)
    master = torch.randn(numel, generator=gen) * covered
    grads = [((torch.randn(numel, generator=gen) * s) * covered).to(grad_dtype) for s in DIV_SCALES]
    out = None if out_dtype is None else torch.full((numel,), 7.0, dtype=out_dtype)
    spec = ADAM_STATE["8bit"]
    tensors = {t.kind: torch.zeros(t.entries(numel), dtype=t.dtype) for t in spec.tensors if t.kind != "master"}
    return Arena8(AdamTensors(spec, {"master": master, **tensors}), grads, out)


def run_kernel8(kernel, arena: Arena8, segments: tuple[GroupRange, ...]) -> None:
    """All steps of the case through ``kernel`` on the 8-bit state, in place."""
    for step, (grad, div) in enumerate(zip(arena.grads, DIV_SCALES), start=1):
        kernel.step(arena.state, grad, arena.out, segments, hypers_at(step), step, div)
