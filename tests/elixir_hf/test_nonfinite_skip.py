"""bf16 and fp32 under the Trainer: one NaN loss is a skipped step, not a NaN model.

Before: the NaN gradient reached Adam and every weight was NaN for the rest of the run, while
the Trainer's log (which filters NaN losses) looked normal. Now the engine skips the step on
every rank, the LR schedule does not advance for it (as for an fp16 overflow) and
``elixir/skipped_steps`` counts it."""

from __future__ import annotations

import math

import pytest
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args
from transformers import TrainerCallback

STEPS, NAN_STEP = 6, 2


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


class _Logged(TrainerCallback):
    """What the reporters receive (``state.log_history`` is copied before the callbacks add to it)."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append(dict(logs or {}))


def _trainer_with_a_nan_step(tmp_path, spec: str, bf16: bool = False):
    args = training_args(str(tmp_path), spec, bf16=bf16, max_steps=STEPS, eval_strategy="no")
    trainer = make_trainer("gpt2", args)
    compute_loss = trainer.compute_loss

    def nan_at_one_step(model, inputs, *rest, **kwargs):
        loss = compute_loss(model, inputs, *rest, **kwargs)
        return loss * float("nan") if trainer.state.global_step == NAN_STEP else loss

    trainer.compute_loss = nan_at_one_step
    return trainer


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_nan_loss_skips_the_step_and_training_goes_on(tmp_path, bf16) -> None:
    trainer = _trainer_with_a_nan_step(tmp_path, OFFLOAD_PLAN, bf16)
    logged = _Logged()
    trainer.add_callback(logged)
    with pytest.warns(RuntimeWarning, match=f"skipped optimizer step {NAN_STEP + 1}: the gradient norm is nan"):
        trainer.train()

    assert trainer.optimizer.skipped_steps == 1
    assert trainer.optimizer.elixir_optimizer.step_count == STEPS - 1
    assert trainer.lr_scheduler.last_epoch == STEPS - 1, "the scheduler advanced on the skipped step"
    skipped = [log["elixir/skipped_steps"] for log in logged.logs if "elixir/skipped_steps" in log]
    assert skipped == [0] * NAN_STEP + [1] * (STEPS - NAN_STEP)
    assert all(math.isfinite(x) for x in history(trainer, "loss", after_step=NAN_STEP + 1))
    state = trainer.model.state_dict()
    assert all(bool(v.float().isfinite().all()) for v in state.values()), "NaN weights after the skipped step"
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_opt_out_through_elixir_spec_keeps_plain_pytorch_behaviour(tmp_path) -> None:
    spec = '{"mode": "static", "skip_nonfinite": false, "max_consecutive_skips": 3}'
    trainer = _trainer_with_a_nan_step(tmp_path, spec)
    trainer.train()
    elixir_optimizer = trainer.optimizer.elixir_optimizer
    assert (elixir_optimizer.skip_nonfinite, elixir_optimizer.max_consecutive_skips) == (False, 3)
    assert trainer.optimizer.skipped_steps == 0
    state = trainer.model.state_dict()
    assert bool(state["transformer.h.0.mlp.c_fc.weight"].isnan().all()), "the NaN step went into Adam, as in PyTorch"
