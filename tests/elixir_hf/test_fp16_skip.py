"""fp16 with the engine's loss scaling under the Trainer: an overflowing step is skipped, the LR
schedule does not advance for it, and the scale backs off so training continues.

fp16 runs on the CPU in the engine; the overflow is forced with a huge initial loss scale
given through ``--elixir`` (and a steep back-off so the second step is clean)."""

from __future__ import annotations

import math

import pytest
import torch
from hf_cases import history, make_trainer, training_args

STEPS = 6
SPEC = '{"loss_scale": {"init_scale": 1e30, "backoff_factor": 1e-26}}'


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def test_overflow_skips_the_step_and_the_schedule(tmp_path) -> None:
    args = training_args(str(tmp_path), SPEC, fp16=True, max_steps=STEPS, eval_strategy="no")
    assert (
        args.elixir_plugin.config.dtype == torch.float16 and args.mixed_precision == "no"
    )  # the engine owns precision
    trainer = make_trainer("gpt2", args)
    trainer.train()

    assert trainer.accelerator.scaler is None  # no GradScaler on top of the engine's scaling
    elixir_optimizer = trainer.optimizer.elixir_optimizer
    assert trainer.optimizer.skipped_steps == 1
    assert elixir_optimizer.step_count == STEPS - 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1, "the scheduler advanced on the skipped step"
    assert elixir_optimizer.loss_scale == pytest.approx(1e4)

    lrs, norms, losses = history(trainer, "learning_rate"), history(trainer, "grad_norm"), history(trainer, "loss")
    assert lrs[0] == lrs[1] == pytest.approx(1e-2), "the step after the skipped one must use the same LR"
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:])), "then the linear schedule decays every step"
    assert not math.isfinite(norms[0]) and all(math.isfinite(n) for n in norms[1:])
    assert all(math.isfinite(x) for x in losses)
