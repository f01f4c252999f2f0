"""Non-finite steps in bf16 and fp32: one NaN loss must not poison the weights.

Before: the NaN gradient went into Adam and every weight was NaN for the rest of the run. Now a
step whose global gradient norm is not finite is skipped on every rank (no update, no Adam state
change, as fp16's loss scaling does), with a warning; ``max_consecutive_skips`` in a row stop
training; ``skip_nonfinite=False`` keeps plain PyTorch behaviour. The reference for a skipped
step is the same run with that step's update left out.
"""

from __future__ import annotations

import math

import pytest
import torch

import elixir_runtime as er
from helpers.dist import run_distributed
from helpers.models import make_mlp_batch, tiny_mlp

STEPS, NAN_STEP, LR, WD = 6, 2, 1e-2, 0.1
CONFIG = dict(mode="static", n_blocks="min", offload=0.5)


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=1e-6)


def _batch(step: int, rank: int, dtype: str) -> dict:
    batch = make_mlp_batch(seed=10 * step + rank)
    batch["x"] = batch["x"].to(er.config.resolve_dtype(dtype))
    return batch


def _engine_run(
    dtype: str, clip: bool, nan_steps=(NAN_STEP,), rank: int = 0, nan_ranks=(0,), drop=(), **cfg
) -> tuple[dict, list[bool]]:
    """Trains ``STEPS`` steps; the loss is NaN at ``nan_steps`` on ``nan_ranks``; the update of
    the steps in ``drop`` is left out (their gradients cleared instead). Weights, skipped flags."""
    model = tiny_mlp(seed=0)
    model, opt = er.prepare(
        model, _adamw(model), er.ElixirConfig(**{**CONFIG, "dtype": dtype, **cfg}), _batch(0, rank, dtype)
    )
    skipped = []
    for step in range(STEPS):
        loss = model(**_batch(step, rank, dtype)).loss
        if step in nan_steps and rank in nan_ranks:
            loss = loss * float("nan")
        opt.backward(loss)
        if clip:
            opt.clip_grad_norm(1.0)
        if step not in drop:
            opt.step()
        skipped.append(opt.step_was_skipped if step not in drop else None)
        opt.zero_grad()
    return {k: v.float() for k, v in model.state_dict().items()}, skipped


def _plain_run(nan: bool) -> dict:
    """Plain PyTorch, fp32: NaN at NAN_STEP (``nan``) or that step's update left out."""
    model = tiny_mlp(seed=0)
    opt = _adamw(model)
    for step in range(STEPS):
        loss = model(**make_mlp_batch(seed=10 * step)).loss
        loss.backward()
        if step != NAN_STEP or nan:
            if nan and step == NAN_STEP:
                for p in model.parameters():
                    p.grad.fill_(float("nan"))
            opt.step()
        opt.zero_grad()
    return model.state_dict()


def _finite(state: dict) -> bool:
    return all(bool(v.isfinite().all()) for v in state.values())


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no-clip"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_nan_loss_skips_that_step_only(dtype, clip) -> None:
    with pytest.warns(RuntimeWarning, match=f"skipped optimizer step {NAN_STEP + 1}: the gradient norm is nan"):
        got, skipped = _engine_run(dtype, clip)
    assert skipped == [s == NAN_STEP for s in range(STEPS)]
    assert _finite(got)
    want, _ = _engine_run(dtype, clip, nan_steps=(), drop=(NAN_STEP,))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    if dtype == "fp32":  # and plain PyTorch without that step agrees
        plain = _plain_run(nan=False)
        for k in plain:
            torch.testing.assert_close(got[k], plain[k], rtol=0, atol=1e-6)


def test_opt_out_keeps_plain_pytorch_behaviour() -> None:
    got, skipped = _engine_run("fp32", clip=False, skip_nonfinite=False)
    assert not any(skipped)
    plain = _plain_run(nan=True)
    assert not _finite(plain)
    for k in plain:  # NaN where PyTorch has NaN
        assert torch.equal(got[k].isnan(), plain[k].isnan()), k


def test_consecutive_skips_stop_training() -> None:
    nan_steps = range(1, STEPS)
    with pytest.warns(RuntimeWarning, match="2 in a row, training stops at 3"):
        with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row .*max_consecutive_skips=3\)"):
            _engine_run("bf16", clip=False, nan_steps=nan_steps, max_consecutive_skips=3)


def test_count_resets_after_a_good_step() -> None:
    _, skipped = _engine_run("fp32", clip=True, nan_steps=(1, 2, 4, 5), max_consecutive_skips=3)
    assert skipped == [False, True, True, False, True, True]


def _rank_run(rank: int, world_size: int) -> tuple[dict, list[bool]]:
    return _engine_run("bf16", clip=False, rank=rank, nan_ranks=(1,))


def test_nan_on_one_rank_skips_the_step_on_every_rank() -> None:
    results = run_distributed(_rank_run, 2, timeout=120)
    for state, skipped in results:
        assert skipped == [s == NAN_STEP for s in range(STEPS)]
        assert _finite(state)
    for k in results[0][0]:
        assert torch.equal(results[0][0][k], results[1][0][k]), k
    assert math.isfinite(sum(float(v.sum()) for v in results[0][0].values()))
