"""CPU tests of the throughput harness: report merging and ratios, model presets, a real CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, throughput
from benchmarks._worker import combine
from benchmarks.models import PRESETS, SEQ, VOCAB, attention_flops_per_token, build_meta, count_params, preset
from benchmarks.throughput import failure

REPO = Path(__file__).resolve().parents[2]
H100 = {"card": "NVIDIA H100 80GB HBM3", "gpu_total_GiB": 79.2, "torch": "2.11.0+cu130", "transformers": "5.17.0"}


def _line(
    system: str, model: str, params: int, batch: int, status: str = "ok", tflops: float | None = None, **extra
) -> str:
    rec = {
        "system": system,
        "model": model,
        "params": params,
        "gpus": 1,
        "batch": batch,
        "seq": 1024,
        "status": status,
        **H100,
        **extra,
    }
    if tflops is not None:
        rec.update(tflops=tflops, step_s=8 * params * batch * 1024 / tflops / 1e12)
    return "[12:00:00] RESULT " + json.dumps(rec)


def _log() -> str:
    p65, p4 = 6_654_210_048, 3_775_340_544
    plan = {"plan": {"host_bytes": 50 * 2**30, "predicted_step_s": 1.0}}
    return "\n".join(
        [
            "some worker noise",
            _line(
                "elixir", "6.5b", p65, 4, tflops=200.0, info=plan, predicted_step_s=1.0, measured_over_predicted=1.08
            ),
            _line("plain", "6.5b", p65, 4, status="OOM", error="CUDA out of memory"),
            _line("fsdp2", "6.5b", p65, 4, status="OOM", error="CUDA out of memory"),
            _line("fsdp2_offload", "6.5b", p65, 4, tflops=84.4),
            _line(
                "ds2_offload",
                "6.5b",
                p65,
                4,
                status="crashed",
                error="worker exit -9 (SIGKILL: likely the host's OOM killer)",
            ),
            _line("ds3_offload", "6.5b", p65, 4, status="unavailable", error="deepspeed not installed"),
            _line("elixir", "gpt2-4b", p4, 8, tflops=295.0),
            _line("plain", "gpt2-4b", p4, 8, tflops=302.0),
            _line("fsdp2_offload", "gpt2-4b", p4, 8, tflops=138.7),
        ]
    )


def test_report_regimes_and_ratio(tmp_path: Path) -> None:
    runs = report.parse_results(_log())
    assert len(runs) == 9
    results = report.write(runs, tmp_path / "results.json")

    (off,) = results["offload_regime"]
    assert (off["model"], off["batch"], off["best_baseline"]) == ("6.5b", 4, "fsdp2_offload")
    assert off["elixir_over_best_baseline"] == pytest.approx(200.0 / 84.4)
    assert off["tflops"]["plain"] is None and off["status"]["plain"] == "OOM"
    assert off["status"]["ds3_offload"] == "unavailable"
    assert off["elixir_predicted_step_s"] == 1.0 and off["elixir_plan_host_GiB"] == pytest.approx(50.0)

    (fit,) = results["in_gpu_regime"]
    assert fit["model"] == "gpt2-4b" and fit["best_baseline"] == "plain"
    assert fit["elixir_over_best_baseline"] == pytest.approx(295.0 / 302.0)

    md = (tmp_path / "benchmarks.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "deepspeed not installed" in md and "**2.37×** vs fsdp2_offload" in md
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_report_keeps_the_hand_written_notes(tmp_path: Path) -> None:
    """docs/benchmarks.md's hand-written section survives a rewrite, before the Runs table."""
    out, md = tmp_path / "results.json", tmp_path / "benchmarks.md"
    report.write(report.parse_results(_log()), out, md)
    notes = f"{report.NOTES_BEGIN}\n## Notes\n\nWritten by hand.\n{report.NOTES_END}"
    md.write_text(md.read_text().replace("\n## Runs\n", f"\n{notes}\n\n## Runs\n"))
    report.write(report.parse_results(_line("elixir", "6.5b", 6_654_210_048, 4, tflops=250.0)), out, md)
    text = md.read_text()
    assert text.count("Written by hand.") == 1 and text.index(report.NOTES_END) < text.index("## Runs")
    assert "**2.96×** vs fsdp2_offload" in text  # the tables were rewritten


def test_report_merge_replaces_same_run_keeps_others(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    report.write(report.parse_results(_log()), out, render=False)
    rerun = report.parse_results(_line("elixir", "6.5b", 6_654_210_048, 4, tflops=250.0))
    h200 = report.parse_results(
        _line("plain", "6.5b", 6_654_210_048, 4, tflops=357.0).replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    )
    results = report.write(rerun + h200, out, render=False)
    assert len(results["runs"]) == 10
    h100_row = next(r for r in results["offload_regime"] if r["card"].startswith("NVIDIA H100"))
    assert h100_row["elixir_over_best_baseline"] == pytest.approx(250.0 / 84.4)
    (h200_row,) = [r for r in results["in_gpu_regime"] if r["card"] == "NVIDIA H200"]
    assert h200_row["elixir_over_best_baseline"] is None  # no Elixir run on that card: no cross-card ratio


def test_regime_from_state_bytes_when_no_in_gpu_baseline_ran() -> None:
    big = {"elixir": {"params": 6_654_210_048, "gpus": 1, "gpu_total_GiB": 79.2}}
    small = {"elixir": {"params": 1_557_686_400, "gpus": 1, "gpu_total_GiB": 79.2}}
    assert report.regime(big) == "offload" and report.regime(small) == "in_gpu"


def test_combine_takes_slowest_rank_and_sums_host_rss() -> None:
    part = {
        "status": "ok",
        "loss": 10.0,
        "gpu_alloc_peak_GiB": 5.0,
        "gpu_reserved_peak_GiB": 6.0,
        "host_used_peak_GiB": 90.0,
    }
    parts = [
        dict(part, step_times_s=[1.0, 2.0, 1.0], host_rss_peak_GiB=40.0, host_rss_start_GiB=1.5),
        dict(
            part,
            step_times_s=[1.5, 1.0, 1.2],
            host_rss_peak_GiB=41.0,
            host_rss_start_GiB=1.5,
            gpu_alloc_peak_GiB=7.0,
            gpu_alloc_retries=3,
        ),
    ]
    base = {"system": "fsdp2_offload", "batch": 4, "seq": 1024, "gpus": 2}
    rec = combine(parts, base, params=10**9)
    assert rec["step_times_s"] == [1.5, 2.0, 1.2] and rec["step_s"] == 1.5
    assert rec["tflops"] == pytest.approx(8e9 * 4 * 1024 / 1.5 / 1e12)
    assert rec["tokens_per_s"] == pytest.approx(2 * 4 * 1024 / 1.5)
    assert rec["host_rss_peak_GiB"] == 81.0 and rec["gpu_alloc_peak_GiB"] == 7.0
    assert rec["gpu_alloc_retries"] == 3  # a rank's retries reach the record
    assert report._added_rss(rec) == 78.0  # what the system holds beyond the bare processes
    assert "cpu_update_Gps_per_rank" not in rec  # no rank updated offloaded chunks on its CPU
    parts = [dict(p, cpu_update_Gps=r) for p, r in zip(parts, (1.7, 1.2))]
    assert combine(parts, base, params=10**9)["cpu_update_Gps_per_rank"] == [1.7, 1.2]
    parts[1] = dict(parts[1], status="OOM", error="CUDA out of memory")
    assert combine(parts, base, params=10**9)["status"] == "OOM"


def test_mfu_counts_attention_over_the_cards_peak() -> None:
    """MFU: 6 x params plus causal attention's 6 x layers x seq x hidden per token, no recompute, over the card's
    dense bf16 peak; a card the table does not know gets none."""
    p = preset("llama3-8b")
    attention = attention_flops_per_token(p, 2048)
    assert attention == 6 * 32 * 2048 * 4096
    part = {"status": "ok", "loss": 1.0, "step_times_s": [2.0], "host_rss_peak_GiB": 1.0, "host_rss_start_GiB": 1.0}
    part.update(gpu_alloc_peak_GiB=1.0, gpu_reserved_peak_GiB=1.0, host_used_peak_GiB=1.0)
    base = {"batch": 4, "seq": 2048, "gpus": 1, "attention_flops_per_token": attention, "card": "NVIDIA H200"}
    rec = combine([part], base, params=8 * 10**9)
    assert rec["mfu"] == pytest.approx((6 * 8e9 + attention) * 4 * 2048 / 2.0 / 989e12)
    assert "mfu" not in combine([part], dict(base, card="a GPU of the future"), params=8 * 10**9)


def test_failure_names_timeouts_and_kills() -> None:
    assert failure(None, [], 420)[0] == "timeout"
    status, error = failure(-9, ["loading", ""], 420)
    assert status == "crashed" and "OOM killer" in error


def _expected_params(n_embd: int, n_layer: int) -> int:
    """Tied GPT-2: embeddings, 12 d^2 + 13 d per block (2 LayerNorms, qkv, proj, 4x MLP), final LayerNorm."""
    return VOCAB * n_embd + SEQ * n_embd + n_layer * (12 * n_embd**2 + 13 * n_embd) + 2 * n_embd


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "tiny"])
def test_preset_parameter_counts(name: str) -> None:
    p = PRESETS[name]
    model = build_meta(p)
    assert count_params(model) == _expected_params(p.n_embd, p.n_layer)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config._attn_implementation == "sdpa" and model.training


def test_preset_sizes_match_the_anchors() -> None:
    billions = {n: count_params(build_meta(PRESETS[n])) / 1e9 for n in ("1.5b", "gpt2-4b", "6.5b", "gpt2-10b")}
    assert billions["gpt2-4b"] == pytest.approx(3.78, abs=0.01) and billions["6.5b"] == pytest.approx(6.65, abs=0.01)
    assert 1.5 < billions["1.5b"] < 1.6 and 9.5 < billions["gpt2-10b"] < 10.5


def _cpu_run(tmp_path: Path, systems: str, first_on_path: Path | None = None) -> dict:
    """``benchmarks.throughput`` on CPU (tiny model, batch 2, seq 64, 2 timed steps); its results.json.
    ``first_on_path``: a folder put before everything else on the workers' PYTHONPATH."""
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.throughput",
        "--model",
        "tiny",
        "--batch-sizes",
        "2",
        "--systems",
        systems,
        "--device",
        "cpu",
        "--seq",
        "64",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    path = [
        str(first_on_path or ""),
        str(REPO / "src"),
        str(REPO),
        os.environ.get("PYTHONPATH", ""),
    ]  # keeps make test's transformers 5.17 overlay
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_cpu_run_of_elixir_and_plain(tmp_path: Path) -> None:
    """The whole path on CPU: parent, one worker per system, RESULT lines, results.json, table and chart."""
    results = _cpu_run(tmp_path, "elixir,plain")
    runs = {r["system"]: r for r in results["runs"]}
    assert set(runs) == {"elixir", "plain"}
    for r in runs.values():
        assert r["status"] == "ok" and r["tflops"] > 0 and len(r["step_times_s"]) == 2, r
        assert r["host_rss_peak_GiB"] > 0 and r["command"].startswith("PYTHONPATH=src python -m benchmarks.throughput")
        assert r["clip"] is True and r["max_grad_norm"] == 1.0 and r["seq"] == 64  # --clip 1 by default
    assert runs["elixir"]["info"]["plan"]["n_chunks"] > 0
    (row,) = results["in_gpu_regime"]
    assert row["best_baseline"] == "plain" and row["elixir_over_best_baseline"] > 0
    assert (tmp_path / "benchmarks.md").exists() and (tmp_path / "throughput.png").exists()


def test_cpu_run_of_the_trainer_path(tmp_path: Path) -> None:
    """``elixir_trainer`` (``ElixirTrainer``, ``--elixir auto``) beside the stock ``Trainer``: whole
    ``Trainer.train()`` loops timed per step; the Elixir figures of the row are the Trainer path's."""
    results = _cpu_run(tmp_path, "elixir_trainer,trainer")
    runs = {r["system"]: r for r in results["runs"]}
    assert set(runs) == {"elixir_trainer", "trainer"}
    for r in runs.values():
        assert r["status"] == "ok" and len(r["step_times_s"]) == 2 and r["info"]["engine_build_s"] > 0, r
    assert runs["elixir_trainer"]["info"]["plan"]["n_chunks"] > 0 and "plan" not in runs["trainer"]["info"]
    # same model, data and seed, AdamW either way: the loop's mean loss is the model's, not the system's
    assert runs["elixir_trainer"]["loss"] == pytest.approx(runs["trainer"]["loss"], rel=1e-3)
    (row,) = results["in_gpu_regime"]
    assert row["elixir_system"] == "elixir_trainer" and row["best_baseline"] == "trainer"


def test_cpu_run_reports_a_missing_package_as_its_row(tmp_path: Path) -> None:
    """A Trainer baseline whose package is not installed is an n/a row naming the fix; the call goes on."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()  # the workers' interpreters find no bitsandbytes and no torchao, installed or not
    (hidden / "sitecustomize.py").write_text("import sys\n\nsys.modules.update(bitsandbytes=None, torchao=None)\n")
    results = _cpu_run(tmp_path, "trainer_lossy,torchao_offload", first_on_path=hidden)
    runs = {r["system"]: r for r in results["runs"]}
    for system, package in (("trainer_lossy", "bitsandbytes"), ("torchao_offload", "torchao")):
        assert runs[system]["status"] == "unavailable" and f"pip install {package}" in runs[system]["error"], runs
    assert "make_fused_wheels.sh" in (tmp_path / "benchmarks.md").read_text()


def test_a_system_whose_package_is_missing_starts_no_worker(monkeypatch) -> None:
    """Its rows are n/a at once, naming the fix; a system with its packages gets a worker per batch size."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    started: list[list[str]] = []
    monkeypatch.setattr(throughput, "run_worker", lambda cmd, env, timeout: started.append(cmd) or (0, [], []))
    args = throughput.parse_args(["--model", "tiny", "--batch-sizes", "2,4", "--device", "cpu"])
    cpu = {"card": "cpu", "driver": None, "gpu_total_GiB": 0.0}
    rows = throughput.run_system(args, "torchao_offload", "tiny", cpu, {})
    assert not started and [r["batch"] for r in rows] == [2, 4]
    assert all(r["status"] == "unavailable" and "pip install torchao" in r["error"] for r in rows), rows
    throughput.run_system(args, "trainer", "tiny", cpu, {})
    assert [cmd[cmd.index("--batch-sizes") + 1] for cmd in started] == ["2", "4"]
