"""One training recipe, run either through Elixir or through a plain-PyTorch reference.

The reference for low-precision runs does exactly the casts Elixir does: an fp32 master model
updated by ``torch.optim.AdamW``, a bf16/fp16 working copy that runs forward and backward (its
``.grad`` accumulates micro-steps in that dtype), gradients cast to fp32 for clipping and the
update, and fp16 dynamic loss scaling with skipped steps.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch

import elixir_runtime as er

from .device import TEST_DEVICE, local_device
from .models import MODEL_BUILDERS, make_batch

VOCAB = 128
MICRO_BATCH = 2
SEQ = 16


@dataclass
class Recipe:
    model: str = "gpt2"
    steps: int = 20
    grad_accum: int = 1
    ac: bool | None = None
    """None: no activation checkpointing; False: non-reentrant; True: reentrant."""
    clip: float | None = 1.0
    lr: float = 1e-2
    weight_decay: float = 0.1
    world_size: int = 1
    dtype: torch.dtype = torch.float32
    init_scale: float = 2.0**10
    growth_interval: int = 5
    # Adam eps=1e-6: with 1e-8 Adam turns round-off-only gradients (e.g. GPT-2's attention key
    # bias, whose true gradient is zero) into lr-sized steps, so any two correct implementations
    # drift apart in those weights.
    eps: float = 1e-6
    device: str = TEST_DEVICE
    """``cpu`` or ``cuda`` (``helpers.device``): where the batches and the reference model are, in each
    process its ``local_device`` (a rank's own GPU); Elixir's is the test device pinned there."""
    meta_ranks: bool = False
    """Ranks other than 0 build the model on the meta device and start from rank 0's weights."""


@dataclass
class Result:
    losses: list[float]
    state: dict[str, torch.Tensor]
    skipped: list[bool] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def batch_for(recipe: Recipe, step: int, micro: int, rank: int | None) -> dict[str, torch.Tensor]:
    """The global batch of a micro-step is ``world_size`` micro-batches; slice ``rank`` is rank
    ``rank``'s (``None``: all of it). Made on this process's device, whichever slice it takes."""
    full = make_batch(
        VOCAB,
        batch=MICRO_BATCH * recipe.world_size,
        seq=SEQ,
        seed=1000 * step + micro,
        device=local_device(recipe.device),
    )
    if rank is None:
        return full
    return {k: v[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH] for k, v in full.items()}


def build(recipe: Recipe, on_device: bool = False, meta: bool = False):
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = MODEL_BUILDERS[recipe.model](seed=0, device=local_device(recipe.device) if on_device else None)
    if recipe.ac is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": recipe.ac})
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, eps=recipe.eps)
    return model, opt


def lr_at(recipe: Recipe, step: int) -> float:
    """A schedule that changes the LR every step, applied through ``param_groups`` as schedulers do."""
    return recipe.lr * (1.0 - 0.5 * step / max(1, recipe.steps))


def run_elixir(recipe: Recipe, rank: int = 0, **config) -> Result:
    """``n_blocks="mid"`` means halfway between the plan's minimum and maximum rCache size."""
    if config.get("n_blocks") == "mid":
        probe_cfg = er.ElixirConfig(
            mode="static", n_blocks="min", dtype=recipe.dtype, chunk_size=config.get("chunk_size")
        )
        probe = er.prepare(*build(recipe), config=probe_cfg)[0]
        plan = probe._elixir.plan
        config["n_blocks"] = (plan.min_blocks + plan.max_blocks) // 2
    model, opt = build(recipe, meta=recipe.meta_ranks and rank > 0)
    cfg = er.ElixirConfig(
        mode="static",
        dtype=recipe.dtype,
        loss_scale=er.LossScaleConfig(init_scale=recipe.init_scale, growth_interval=recipe.growth_interval),
        **config,
    )
    model, opt = er.prepare(model, opt, config=cfg, example_batch=batch_for(recipe, 0, 0, rank))
    losses, skipped = [], []
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        for micro in range(recipe.grad_accum):
            loss = model(**batch_for(recipe, step, micro, rank)).loss / recipe.grad_accum
            opt.backward(loss)
            losses.append(loss.item())
        if recipe.clip is not None:
            opt.clip_grad_norm(recipe.clip)
        opt.step()
        skipped.append(opt.step_was_skipped)
        opt.zero_grad()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return Result(losses, state, skipped, dict(model._elixir.runtime.stats))


def run_reference(recipe: Recipe) -> Result:
    """Plain PyTorch on the global batch (no sharding), mixed precision by explicit casts."""
    master, opt = build(recipe, on_device=True)
    low = recipe.dtype != torch.float32
    work = copy.deepcopy(master) if low else master
    if low:  # parameters in the compute dtype, buffers (e.g. RoPE inv_freq) untouched, as Elixir does
        for p in work.parameters():
            p.data = p.data.to(recipe.dtype)
    scale = recipe.init_scale if recipe.dtype == torch.float16 else 1.0
    good = 0
    losses, skipped = [], []
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        for micro in range(recipe.grad_accum):
            full = batch_for(recipe, step, micro, None)
            # mean over ranks of per-rank mean losses == what Elixir's averaged gradients give
            parts = [
                {k: v[r * MICRO_BATCH : (r + 1) * MICRO_BATCH] for k, v in full.items()}
                for r in range(recipe.world_size)
            ]
            for r, part in enumerate(parts):
                loss = work(**part).loss / recipe.grad_accum
                (loss * scale / recipe.world_size).backward()
                if r == 0:
                    losses.append(loss.item())
        if low:
            for p, w in zip(master.parameters(), work.parameters()):
                p.grad = None if w.grad is None else w.grad.float() / scale
                w.grad = None
        params = [p for p in master.parameters() if p.grad is not None]
        if recipe.dtype == torch.float16 and not all(torch.isfinite(p.grad).all() for p in params):
            scale, good = scale / 2, 0
            skipped.append(True)
            opt.zero_grad()
            continue
        if recipe.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        opt.zero_grad()
        skipped.append(False)
        if recipe.dtype == torch.float16:
            good += 1
            if good % recipe.growth_interval == 0:
                scale *= 2
        if low:
            with torch.no_grad():
                for p, w in zip(master.parameters(), work.parameters()):
                    w.copy_(p)
    state = {k: v.detach().cpu().clone() for k, v in master.state_dict().items()}
    return Result(losses, state, skipped)


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """On the CPU: the engine's state dicts are there, a reference model's on the test device."""
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


def assert_close_losses(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=rtol, abs_tol=rtol), f"micro-step {i}: {g} vs {w}"
