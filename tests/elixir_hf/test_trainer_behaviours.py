"""The stock Trainer's behaviours that scripts and transformers' own tests rely on, each run once with the
stock ``Trainer`` and once with ``ElixirTrainer`` (a tiny GPT-2, fp32, CPU), asserting the same results:
weights read from ``model.parameters()`` after ``train``/``evaluate``/``predict``, a model trained twice
(by the same Trainer, and by a second one with other arguments), resume with and without gradient
accumulation (``log_history`` equal to the uninterrupted run's), best-model tracking, callbacks' events,
schedulers; then the Trainer's flags and words (``--enable_jit_checkpoint``, no checkpoint to resume).

Tolerance: relative 1e-5 on logged values (the runs differ in summation order only, ~1e-7 observed:
test_trainer_parity.py); weights also absolute ``ATOL``.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_cases import make_trainer, training_args
from transformers import Trainer, TrainerCallback

RTOL = 1e-5
ATOL = 1e-5
"""Weights: Adam turns round-off differences of near-zero gradients into steps of up to the learning rate's
size; 1.6e-6 observed after a second run at lr 3e-3, several hundred times less than one such step."""
MEASURED = ("_runtime", "_per_second")
"""Keys of ``log_history`` that time the run (the stock Trainer's) and differ between any two runs."""


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def _args(out: Path, elixir: bool, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(max_steps=4, gradient_accumulation_steps=1, eval_strategy="no", logging_steps=1)
    kwargs.update(overrides)
    return training_args(str(out), "auto" if elixir else None, **kwargs)


def _both(tmp_path: Path, run: Any) -> tuple[Any, Any]:
    """``run(out, elixir)`` with the stock Trainer and with Elixir, each in a folder of its own."""
    return run(tmp_path / "stock", False), run(tmp_path / "elixir", True)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL, msg=name)


def _history(trainer: Trainer) -> list[dict[str, Any]]:
    """``log_history`` without the engine's measurements (``elixir/*``) and the run's timings."""
    return [
        {k: v for k, v in h.items() if not k.startswith("elixir/") and not k.endswith(MEASURED)}
        for h in trainer.state.log_history
    ]


def _assert_same_history(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [sorted(h) for h in got] == [sorted(h) for h in want]
    for g, w in zip(got, want):
        for k, v in w.items():
            ok = math.isclose(g[k], v, rel_tol=RTOL) if isinstance(v, float) else g[k] == v
            assert ok, f"step {w.get('step')}: {k} {g[k]} vs {v}"


# ---------------------------------------------------------------------------- weights readable
def test_weights_read_after_train_evaluate_and_predict(tmp_path) -> None:
    def run(out: Path, elixir: bool) -> list[dict[str, torch.Tensor]]:
        trainer = make_trainer("gpt2", _args(out, elixir), n_train=16)
        seen = []
        trainer.evaluate()  # before training: the engine is built for it
        seen.append(_params(trainer.model))
        trainer.train()
        seen.append(_params(trainer.model))
        trainer.predict(trainer.eval_dataset)
        seen.append(_params(trainer.model))
        return seen

    stock, ours = _both(tmp_path, run)
    for got, want in zip(ours, stock):
        _assert_same_weights(got, want)


def test_no_engine_hook_is_left_on_a_module_after_training(tmp_path) -> None:
    trainer = make_trainer("gpt2", _args(tmp_path, True, max_steps=1), n_train=4)
    trainer.train()
    embedding = trainer.model.get_input_embeddings()
    assert not embedding._forward_hooks and not embedding._forward_pre_hooks  # NEFTune's test counts them
    assert all(not m._forward_hooks for m in trainer.model.modules() if m is not trainer.model)
    trainer.train()  # the next step takes the parameters and the hooks back
    assert trainer.state.global_step == 1


# ---------------------------------------------------------------------------- trained again
def test_the_same_trainer_trains_twice(tmp_path) -> None:
    """A second ``train()`` restarts the schedule and keeps the optimizer (its Adam state), as stock."""

    def run(out: Path, elixir: bool) -> tuple[Any, ...]:
        trainer = make_trainer("gpt2", _args(out, elixir, max_steps=2), n_train=8)
        trainer.train()
        first = _history(trainer)
        trainer.train()
        return first, _history(trainer), _params(trainer.model)

    stock, ours = _both(tmp_path, run)
    _assert_same_history(ours[0], stock[0])
    _assert_same_history(ours[1], stock[1])
    _assert_same_weights(ours[2], stock[2])


def test_a_second_trainer_with_other_arguments_continues_from_the_trained_model(tmp_path) -> None:
    def run(out: Path, elixir: bool) -> tuple[Any, ...]:
        first = make_trainer("gpt2", _args(out / "a", elixir, max_steps=2), n_train=8)
        first.train()
        args = _args(out / "b", elixir, max_steps=2, per_device_train_batch_size=4, learning_rate=3e-3)
        second = make_trainer(first.model, args, n_train=8)
        second.train()
        return _history(second), _params(second.model)

    stock, ours = _both(tmp_path, run)
    _assert_same_history(ours[0], stock[0])
    _assert_same_weights(ours[1], stock[1])


# ---------------------------------------------------------------------------- resume
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_resumed_run_logs_the_uninterrupted_runs_history(tmp_path, accumulation: int) -> None:
    def run(out: Path, elixir: bool) -> tuple[Any, ...]:
        kw = dict(max_steps=4, gradient_accumulation_steps=accumulation, save_strategy="steps", save_steps=2)
        straight = make_trainer("gpt2", _args(out / "straight", elixir, **kw), n_train=16)
        straight.train()
        resumed = make_trainer("gpt2", _args(out / "straight", elixir, **kw), n_train=16)
        resumed.train(resume_from_checkpoint=str(out / "straight" / "checkpoint-2"))
        return straight, resumed

    (stock, stock_resumed), (ours, ours_resumed) = _both(tmp_path, run)
    # train_loss: the mean over the steps this train() ran, the resumed ones only (the stock Trainer's too)
    _assert_same_history(_history(ours_resumed)[:-1], _history(ours)[:-1])
    _assert_same_history(_history(ours), _history(stock))
    _assert_same_history(_history(ours_resumed), _history(stock_resumed))
    plan_logs = [h for h in ours_resumed.state.log_history if "elixir/plan_chunks" in h]
    assert [h["step"] for h in plan_logs] == [1]  # the plan's shape in the first log only, not again on resume
    _assert_same_weights(_params(ours_resumed.model), _params(stock_resumed.model))


def test_resume_from_true_without_a_checkpoint_says_what_the_stock_trainer_says(tmp_path) -> None:
    for out, elixir in ((tmp_path / "stock", False), (tmp_path / "elixir", True)):
        trainer = make_trainer("gpt2", _args(out, elixir), n_train=4)
        with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory \("):
            trainer.train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------- best model, callbacks, schedules
class Events(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda args, state, control, **kw: self.events.append((name, state.global_step))
        return super().__getattribute__(name)


def test_best_model_callbacks_and_schedule(tmp_path) -> None:
    def run(out: Path, elixir: bool) -> tuple[Any, ...]:
        args = _args(
            out,
            elixir,
            max_steps=6,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            save_total_limit=1,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            learning_rate=5e-2,  # large enough that the eval loss rises again: the best is not the last
        )
        trainer = make_trainer("gpt2", args, n_train=24)
        events = Events()
        trainer.add_callback(events)
        trainer.train()
        state = trainer.state
        best = Path(state.best_model_checkpoint).name
        return best, state.best_metric, _history(trainer), events.events, _params(trainer.model)

    stock, ours = _both(tmp_path, run)
    assert ours[0] == stock[0] and math.isclose(ours[1], stock[1], rel_tol=RTOL)
    _assert_same_history(ours[2], stock[2])
    assert ours[3] == stock[3]
    _assert_same_weights(ours[4], stock[4])  # the best checkpoint's weights, loaded at the end


# ---------------------------------------------------------------------------- --enable_jit_checkpoint
class Terminate(TrainerCallback):
    """Sends this process SIGTERM inside step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_jit_checkpoint_saves_on_sigterm_through_the_engine_and_train_returns(tmp_path) -> None:
    args = _args(tmp_path, True, max_steps=6, enable_jit_checkpoint=True)
    trainer = make_trainer("gpt2", args, n_train=24)
    assert not any(type(c).__name__ == "JITCheckpointCallback" for c in trainer.callback_handler.callbacks)
    trainer.add_callback(Terminate(at=2))
    before = signal.getsignal(signal.SIGTERM)
    trainer.train()  # returns, as with the stock JIT checkpoint: no SystemExit
    # before step 2's forward: its check-in tells every rank, and step 2 ends the run with its checkpoint
    assert trainer.state.global_step == 2
    assert (tmp_path / "checkpoint-2" / "elixir_checkpoint.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is before
    resumed = make_trainer("gpt2", _args(tmp_path, True, max_steps=6), n_train=24)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
