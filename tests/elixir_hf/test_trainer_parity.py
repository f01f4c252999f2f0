"""ElixirTrainer against the stock Trainer: same tiny model, seed, data and arguments.

20 optimizer steps of gradient accumulation 2 (40 micro-batches), clipping active
(max_grad_norm 0.5 < the typical norm), evaluation every 5 steps. Tolerance: relative 1e-5 on
every logged training loss, grad norm and eval loss (fp32 on CPU; the two runs differ only in
summation order inside Adam, the norm and the loss: ElixirTrainer computes it with the lean
causal-LM loss, ``elixir_hf/loss.py``; ~1e-7 observed).
"""

from __future__ import annotations

import json
import math

import pytest
from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args
from transformers.loss.loss_utils import ForCausalLMLoss

from elixir_hf.loss import lean_causal_lm_loss

RTOL = 1e-5


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) > 0, (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=RTOL), f"{what}[{i}]: elixir {g} vs stock {w}"


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("elixir", ["auto", OFFLOAD_PLAN], ids=["auto", "offload-half-min-rcache"])
def test_losses_match_stock_trainer(tmp_path, model: str, elixir: str) -> None:
    stock = make_trainer(model, training_args(str(tmp_path / "stock")))
    stock.train()
    ours = make_trainer(model, training_args(str(tmp_path / "elixir"), elixir))
    ours.train()

    assert hasattr(ours.model, "_elixir") and not hasattr(stock.model, "_elixir")
    assert ours.model.loss_function is lean_causal_lm_loss and stock.model.loss_function is ForCausalLMLoss
    assert len(history(ours, "loss")) == 20
    for key in ("loss", "grad_norm", "eval_loss", "learning_rate"):
        _assert_close(history(ours, key), history(stock, key), key)


def test_elixir_off_is_the_stock_trainer(tmp_path) -> None:
    from elixir_hf import ElixirTrainer

    plain = make_trainer("gpt2", training_args(str(tmp_path), "off", max_steps=2, eval_strategy="no"))
    assert plain.args.elixir_plugin is None
    ours = ElixirTrainer(model=plain.model, args=plain.args, train_dataset=plain.train_dataset)
    ours.train()
    assert not hasattr(ours.model, "_elixir")
    assert type(ours.accelerator).__name__ == "Accelerator"


def test_evaluate_before_train_runs_on_the_engine(tmp_path) -> None:
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock")))
    ours = make_trainer("gpt2", training_args(str(tmp_path / "elixir"), OFFLOAD_PLAN))
    want, got = stock.evaluate()["eval_loss"], ours.evaluate()["eval_loss"]
    assert hasattr(ours.model, "_elixir")
    assert math.isclose(got, want, rel_tol=RTOL)
    ours.train()  # the engine built for evaluation is the one that trains
    stock.train()
    _assert_close(history(ours, "loss"), history(stock, "loss"), "loss")


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress-bar"])
def test_engine_metrics_reach_log_history_and_reporters_not_the_console(tmp_path, capsys, disable_tqdm) -> None:
    from transformers import TrainerCallback

    seen: list[dict] = []

    class Reporter(TrainerCallback):  # what TensorBoard, W&B, ... receive
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                seen.append(dict(logs))

    args = training_args(
        str(tmp_path),
        OFFLOAD_PLAN,
        max_steps=4,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=4,
        disable_tqdm=disable_tqdm,
    )
    trainer = make_trainer("gpt2", args)
    trainer.add_callback(Reporter())
    trainer.train()

    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in saved if "loss" in h]
    assert len(seen) == len(logged) == 4
    for reported, kept in zip(seen, logged):
        assert {k: v for k, v in kept.items() if k.startswith("elixir/")} == {
            k: v for k, v in reported.items() if k.startswith("elixir/")
        }
    first, last = logged[0], logged[-1]
    assert first["elixir/plan_offloaded_chunks"] > 0 and "elixir/plan_chunks" in first
    assert "elixir/plan_chunks" not in last
    for key in (
        "elixir/loss_scale",
        "elixir/skipped_steps",
        "elixir/host_rss_gib",
        "elixir/step_s",
        "elixir/backward_s",
        "elixir/optimizer_s",
        "elixir/forward_other_s",
        "elixir/reduces_per_step",
        "elixir/cpu_update_s_per_step",
        "elixir/update_wait_s_per_step",
        "elixir/update_stall_s_per_step",
    ):
        assert key in last, key
    # the offloaded chunks' CPU update, its seconds and rate per step, in the logs whose window it
    # ran in (it runs beside the next step: a log right after a step may precede it)
    ran = [log for log in logged if log["elixir/cpu_update_s_per_step"] > 0]
    assert ran and sum(log["elixir/updated_cpu_per_step"] for log in logged) > 0
    for log in ran:
        assert log["elixir/cpu_update_Gps"] == pytest.approx(
            log["elixir/updated_cpu_per_step"] / log["elixir/cpu_update_s_per_step"] / 1e9
        )
    assert last["elixir/loss_scale"] == 1.0 and last["elixir/skipped_steps"] == 0
    assert last["elixir/backward_s"] > 0 and last["elixir/reduces_per_step"] > 0
    assert last["elixir/step_s"] >= last["elixir/backward_s"] + last["elixir/optimizer_s"]

    console = capsys.readouterr().out
    lines = [line for line in console.splitlines() if "'loss'" in line]
    assert len(lines) == 4  # (the plan is an INFO log line: test_distributed.py)
    for line in lines:
        assert "elixir/" not in line and "s/step, host" in line and len(line) < 200, line


def test_console_summary() -> None:
    from elixir_hf.callback import console_logs

    logs = {
        "loss": 1.5,
        "elixir/step_s": 0.2134,
        "elixir/gpu_peak_gib": 4.12,
        "elixir/host_rss_gib": 2.31,
        "elixir/skipped_steps": 0,
        "elixir/loss_scale": 1.0,
        "elixir/gathers_per_step": 40.0,
    }
    assert console_logs(logs) == {"loss": 1.5, "elixir": "0.213 s/step, GPU peak 4.12 GiB, host 2.31 GiB"}
    fp16 = {**logs, "elixir/skipped_steps": 2, "elixir/loss_scale": 16384.0}
    assert console_logs(fp16)["elixir"].endswith("host 2.31 GiB, 2 skipped, loss scale 1.64e+04")
    assert console_logs({"eval_loss": 2.0}) == {"eval_loss": 2.0}
