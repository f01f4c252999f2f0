"""``benchmarks.quality`` on the CPU: the tiny model pretrained, then fine-tuned at a small lr by the
exact arm (``ElixirTrainer``, fp32 masters) and by bf16 weights + AdamW from the same start and data.
Updates below half a bf16 spacing are lost in the bf16 arm: it moves fewer weights and lowers the
held-out loss less. An arm whose package is missing is a ``not run`` row; split runs merge."""

from __future__ import annotations

import json
import math
import sys

import pytest

from benchmarks import quality


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch: pytest.MonkeyPatch, hardware_in) -> None:
    """The recipe's corpus, tokenizer and datasets caches in ``tmp_path`` (with this machine's hardware
    profile); Elixir only where asked."""
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    hardware_in(tmp_path / "cache")
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def _last_line(capsys: pytest.CaptureFixture) -> dict:
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_exact_keeps_the_small_updates_that_bf16_loses(tmp_path, capsys) -> None:
    out = tmp_path / "quality.json"
    quality.main(
        ["--size", "tiny", "--device", "cpu", "--steps", "16", "--evals", "1", "--lrs", "1e-5", "--seeds", "0",
         "--arms", "exact,bf16_adamw", "--out", str(out)]
    )  # fmt: skip
    rec = json.loads(out.read_text())
    assert _last_line(capsys) == rec
    assert rec["pretrain"]["eval_loss"] < math.log(rec["pretrain"]["vocab"]) - 1  # pretraining learned
    assert min(rec["blocks"].values()) > 0
    runs = {r["arm"]: r for r in rec["runs"]}
    assert set(runs) == {"exact", "bf16_adamw"}
    for r in runs.values():
        assert r["status"] == "ok" and (r["lr"], r["seed"]) == (1e-5, 0)
        assert [step for step, _ in r["eval"]] == [0, 8, 16]
        assert r["eval"][0][1] == r["start_eval_loss"] and r["eval"][-1][1] == r["final_eval_loss"]
        assert r["wall_s"] > 0 and 0 <= r["moved"] <= 1
    exact, bf16 = runs["exact"], runs["bf16_adamw"]
    # the same start and the same forward numerics: only the updates differ
    assert exact["start_eval_loss"] == pytest.approx(bf16["start_eval_loss"], rel=1e-6)
    # fp32 masters carry every update into the bf16 weights the forward reads; bf16 weights drop most
    assert exact["moved"] > 3 * bf16["moved"] > 0, (exact["moved"], bf16["moved"])
    gain = {arm: r["start_eval_loss"] - r["final_eval_loss"] for arm, r in runs.items()}
    assert gain["exact"] > max(gain["bf16_adamw"], 0), gain
    rows = rec["table"].splitlines()
    assert len(rows) == 4 and rows[2].startswith("| Elixir exact") and rows[3].startswith("| bf16 + AdamW | 1e-05")
    assert f"{bf16['final_eval_loss'] - exact['final_eval_loss']:+.4f}" in rows[3]  # the gap to exact


def test_an_arm_whose_package_is_missing_is_a_not_run_row(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "optimi", None)  # importlib.util.find_spec("optimi") is None
    quality.main(["--size", "tiny", "--device", "cpu", "--arms", "bf16_kahan", "--seeds", "0,1", "--lrs", "1e-5"])
    rec = _last_line(capsys)
    assert [r["status"] for r in rec["runs"]] == ["not run: torch-optimi missing"] * 2
    assert "pretrain" not in rec  # nothing to fine-tune: nothing trained
    assert "| bf16 + Kahan summation | 1e-05 | not run: torch-optimi missing |" in rec["table"]


def test_records_of_a_split_benchmark_merge_into_one_table(tmp_path, capsys) -> None:
    def record(arm: str, final: float) -> dict:
        run = {"arm": arm, "lr": 1e-5, "seed": 0, "status": "ok", "start_eval_loss": 3.0, "final_eval_loss": final,
               "moved": 0.5, "wall_s": 10.0}  # fmt: skip
        return {"size": "small", "steps": 300, "evals": 5, "warmup": 0.1, "lrs": [1e-5], "seeds": [0],
                "arms": {arm: quality.ARMS[arm].title}, "device": "gpu", "pretrain": {"eval_loss": 3.1}, "runs": [run]}  # fmt: skip

    paths = []
    for arm, final in (("bf16_adamw", 2.99), ("exact", 2.9)):
        paths.append(tmp_path / f"{arm}.json")
        paths[-1].write_text(json.dumps(record(arm, final)))
    quality.main(["--merge", *map(str, paths)])
    rec = _last_line(capsys)
    assert list(rec["arms"]) == ["exact", "bf16_adamw"] and len(rec["runs"]) == 2
    assert "| bf16 + AdamW | 1e-05 | 2.9900 ± 0.0000 | -0.0100 | +0.0900 | 50.0% | 10 |" in rec["table"]
    other = record("bf16_kahan", 2.9) | {"pretrain": {"eval_loss": 3.2}}
    paths[0].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different pretrained models"):
        quality.main(["--merge", *map(str, paths)])
