"""The Trainer-path baselines of the throughput harness on CPU: ``--liger`` and the new systems parse and
reach the workers and ``TrainingArguments``, a missing package is an n/a row, liger runs are rows of
their own in the report. Nothing here needs liger-kernel, bitsandbytes or torchao installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from benchmarks import _worker, hf_systems, report
from benchmarks.harness import STOCK_TRAINERS, TRAINER_SYSTEMS, Context, Unavailable
from benchmarks.models import preset, vocab_size
from benchmarks.systems import build
from benchmarks.throughput import PER_BATCH_SYSTEMS, parse_args, worker_command

NEW = ("trainer_lossy", "torchao_offload", "torchao_offload_bf16")
CPU = torch.device("cpu")


def test_liger_compile_and_the_new_systems_parse_and_reach_the_workers() -> None:
    argv = ["--model", "llama3-8b", "--batch-sizes", "8,4", "--systems", ",".join(TRAINER_SYSTEMS)]
    args = parse_args([*argv, "--liger", "--compile"])
    assert args.liger and args.compile and args.systems == ["elixir_trainer", "elixir_trainer_8bit", "trainer", *NEW]
    assert args.batch_sizes == [4, 8]
    for system in args.systems:
        assert system in PER_BATCH_SYSTEMS  # a Trainer and its optimizer per worker
        cmd = worker_command(args, system, "llama3-8b", [4])
        worker = _worker.parse_args(cmd[cmd.index("benchmarks._worker") + 1 :])
        assert worker.liger and worker.compile and worker.system == system
    plain = worker_command(parse_args(argv), "trainer", "llama3-8b", [4])
    assert "--liger" not in plain and "--compile" not in plain


@pytest.mark.parametrize("system, optim", [("trainer", None), ("trainer_lossy", "paged_adamw_8bit")])
@pytest.mark.parametrize("liger, compile", [(False, False), (True, False), (True, True)])
def test_training_arguments_carry_the_fused_kernels_and_the_optimizer(
    system: str, optim: str | None, liger: bool, compile: bool, tmp_path: Path
) -> None:
    ctx = Context(CPU, 1, 0, seq=32, liger=liger, compile=compile)
    fields = hf_systems.training_fields(ctx, str(tmp_path), 4, 5, STOCK_TRAINERS[system].optim)
    args = TrainingArguments(**fields)
    assert (
        args.use_liger_kernel is liger
        and args.torch_compile is compile
        and args.max_steps == 5
        and args.per_device_train_batch_size == 4
    )
    assert args.optim == (optim or TrainingArguments(output_dir=str(tmp_path)).optim)
    assert args.max_grad_norm == 1.0 and args.learning_rate == 1e-4 and args.weight_decay == 0.01


def test_liger_reaches_the_trainer_in_its_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--liger``: the stock Trainer's ``train()`` applies Liger to the model (the call recorded, not run)."""
    import transformers.trainer

    required, applied = [], []
    monkeypatch.setattr(hf_systems, "_require", lambda module, package, info: required.append(package))
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", lambda model, config: applied.append(model))
    p = preset("tiny")
    ids = torch.randint(0, vocab_size(p), (2, 32), generator=torch.Generator().manual_seed(0))
    trainer = build("trainer", p, Context(CPU, 1, 0, seq=32, threads=1, liger=True), ids)
    times, loss = trainer.timed(ids, 0, 1)
    assert required == ["liger-kernel"] and len(applied) == 1 and len(times) == 1 and loss > 0
    assert trainer.info["liger"] is True and trainer.info["weights_dtype"] == "float32"


@pytest.mark.parametrize(
    "system, liger, hidden, package",
    [
        ("trainer_lossy", False, "bitsandbytes", "bitsandbytes"),
        ("torchao_offload", False, "torchao", "torchao"),
        ("torchao_offload_bf16", False, "torchao", "torchao"),
        ("trainer", True, "liger_kernel", "liger-kernel"),
        ("elixir_trainer", True, "liger_kernel", "liger-kernel"),
    ],
)
def test_a_missing_package_makes_the_system_unavailable_naming_the_fix(
    system: str, liger: bool, hidden: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, hidden, None)  # import fails, installed or not
    ids = torch.zeros(2, 32, dtype=torch.long)
    with pytest.raises(Unavailable, match=f"{package} not installed.*pip install {package}.*make_fused_wheels.sh"):
        build(system, preset("tiny"), Context(CPU, 1, 0, seq=32, liger=liger), ids)


def test_the_worker_reports_a_missing_package_as_an_unavailable_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as on CI, installed here or not: checked first
    argv = ["--system", "torchao_offload", "--model", "tiny", "--batch-sizes", "2,4", "--seq", "32", "--device", "cpu"]
    threads = str(torch.get_num_threads())  # the worker sets it for the process: keep this one's
    _worker.run(_worker.parse_args([*argv, "--threads", threads, "--steps", "1", "--warmup", "0", "--liger"]))
    runs = report.parse_results(capsys.readouterr().out)
    assert [r["batch"] for r in runs] == [2, 4]
    for r in runs:
        assert r["status"] == "unavailable" and "liger-kernel not installed" in r["error"], r
        assert r["liger"] is True  # --liger reaches a Trainer-path system, whatever its fate


def _run(system: str, liger: bool, tflops: float, compile: bool = False) -> dict:
    return {
        "system": system,
        "model": "llama3-8b",
        "params": 8_030_261_248,
        "gpus": 1,
        "seq": 2048,
        "batch": 4,
        "clip": True,
        "liger": liger,
        "compile": compile,
        "status": "ok",
        "tflops": tflops,
        "card": "NVIDIA H100 80GB HBM3",
        "gpu_total_GiB": 79.2,
        "torch": "2.11.0+cu130",
        "transformers": "5.17.0",
        "info": {"liger-kernel": "0.8.5", "bitsandbytes": "0.50.2"} if liger else {},
    }


def test_report_keeps_fused_kernel_runs_apart_from_the_others(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    old = [_run("elixir_trainer", False, 400.0), {**_run("trainer", False, 0.0), "status": "OOM"}]
    report.write(old, out, render=False)
    new = [_run("elixir_trainer", True, 420.0), _run("trainer_lossy", True, 350.0), _run("torchao_offload", True, 90.0)]
    new += [_run("elixir_trainer", True, 450.0, compile=True), _run("trainer_lossy", True, 360.0, compile=True)]
    results = report.write(new, out)
    assert len(results["runs"]) == 7  # a run with Liger or compile replaces none of the runs without
    rows = {row["kernels"]: row for row in results["offload_regime"]}
    assert rows["off"]["tflops"] == {"elixir_trainer": 400.0, "trainer": None}
    assert rows["Liger"]["tflops"] == {"elixir_trainer": 420.0, "trainer_lossy": 350.0, "torchao_offload": 90.0}
    assert rows["Liger"]["best_baseline"] == "trainer_lossy"
    assert rows["Liger"]["elixir_over_best_baseline"] == pytest.approx(420.0 / 350.0)
    assert rows["Liger + compile"]["elixir_over_best_baseline"] == pytest.approx(450.0 / 360.0)
    md = (tmp_path / "benchmarks.md").read_text()
    assert "| NVIDIA H100 80GB HBM3 | llama3-8b | 1 | 2048 | 4 | 1.0 | Liger | 420.0 | – | 350.0 | 90.0 |" in md
    assert "| NVIDIA H100 80GB HBM3 | llama3-8b | 1 | 2048 | 4 | 1.0 | off | 400.0 | OOM | – | – |" in md
    assert "| 4 | 1.0 | Liger + compile | 450.0 | – | 360.0 | – |" in md
    assert "transformers 5.17.0, Liger Kernel 0.8.5, bitsandbytes 0.50.2" in md
