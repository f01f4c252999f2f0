"""``benchmarks.dpo`` on CPU: the Elixir and stock DPO systems train a tiny Llama against a reference equal
to the policy, and the record's FLOPs, ratios and plan are what the docstring says."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import dpo
from benchmarks.models import param_count, preset

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    config = tmp_path_factory.mktemp("tiny") / "config.json"
    config.write_text(json.dumps(TINY))
    out = {}
    for system in ("elixir", "dpo"):
        argv = ["--model", str(config), "--device", "cpu", "--batch", "2", "--prompt", "8", "--completion", "7"]
        out[system] = dpo.run_system(dpo.parse_args([*argv, "--steps", "2", "--warmup", "1", "--system", system]))
    return out


def test_both_systems_train_against_a_reference_equal_to_the_policy(records) -> None:
    for rec in records.values():
        assert rec["status"] == "ok" and rec["seq"] == 8 + 7 + 1
        assert len(rec["step_times_s"]) == 2 and len(rec["losses"]) == 3
        assert rec["losses"][0] == pytest.approx(math.log(2), rel=1e-6)  # reference = the starting policy
        assert rec["margins"][-1] != 0  # the policy moved
    plan = records["elixir"]["plan"]
    assert plan["moments"] == "fp32" and plan["reference_offloaded_chunks"].split("/")[0] != "0"
    assert (
        "predicted_policy_step_s" in records["elixir"] and "plan" not in records["dpo"]
    )  # None on a CPU: not searched


def test_flops_count_the_policy_step_and_the_reference_forward(records) -> None:
    rec = records["elixir"]
    params = param_count(preset(rec["model"]), rec["seq"])
    tokens = 2 * rec["batch"] * rec["seq"]
    assert rec["tflops"] * rec["step_s"] * 1e12 == pytest.approx((8 + 2) * params * tokens, rel=1e-9)
    assert rec["tokens_per_s"] * rec["step_s"] == pytest.approx(tokens)


def test_the_table_compares_with_the_lossy_baseline() -> None:
    base = {"card": "H", "model": "m", "batch": 4, "seq": 1024, "pairs_per_s": 1.0, "tflops": 1.0}
    base.update(host_rss_peak_GiB=1.0, losses=[0.69], status="ok")
    rows = [{**base, "system": "elixir", "step_s": 2.0}, {**base, "system": "dpo_lossy", "step_s": 3.0}]
    rows.append({"system": "dpo", "model": "m", "batch": 4, "status": "OOM", "error": "CUDA out of memory"})
    text = dpo.table(rows)
    assert "| elixir | 4 | 1024 | 2.00 |" in text and "| 1.50x |" in text
    assert "| dpo | 4 | – | OOM: CUDA out of memory |" in text


def test_an_unknown_system_is_refused_naming_the_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        dpo.parse_args(["--systems", "elixir,deepspeed"])
    assert "unknown deepspeed; choose from elixir, elixir_8bit, dpo_lossy, dpo" in capsys.readouterr().err
