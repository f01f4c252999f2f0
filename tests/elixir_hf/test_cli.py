"""``elixir-plan``: presets, config files, JSON and PNG output, failures, and its speed on OPT-175B."""

from __future__ import annotations

import json

import pytest

from elixir_hf.cli import main, parse_size
from elixir_runtime.hardware import HardwareProfile, LinkRates


@pytest.fixture
def hardware(tmp_path) -> str:
    """A made-up two-GPU host (test data; the CLI measures or loads real ones)."""
    hw = HardwareProfile(
        device="test GPU", gpus=2, gpu_memory=80 * 2**30, host_memory=256 * 2**30, cpu_cores=16,
        matmul={"1024": 300e12, "4096": 600e12}, attention=300e12, memory_bandwidth=3e12, op_overhead=1e-5,
        gpu_adam=80e9, cpu_adam=5e9, links={n: LinkRates(n, 50e9 * n, 50e9 * n, 35e9 * n) for n in (1, 2)},
        source="test data",
    )
    path = tmp_path / "hw.json"
    hw.save(path)
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * 2**30 == parse_size("80G") == parse_size("80")
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5TiB") == int(1.5 * 2**40)
    assert parse_size("512mib") == 512 * 2**20
    with pytest.raises(Exception, match="not a memory size"):
        parse_size("80 bananas")


def test_preset_plan_as_json(capsys, hardware) -> None:
    code, out, _ = _run(capsys, "--model", "gpt2", "--batch-size", "4", "--seq-len", "256", "--gpu-mem", "3GiB",
                        "--host-mem", "64GiB", "--hardware", hardware, "--json")
    assert code == 0
    doc = json.loads(out)
    plan = doc["plan"]
    assert plan["n_chunks"] > 0 and plan["predicted"]["total"] > 0
    assert plan["memory"]["rcache"] + plan["memory"]["private"] + plan["memory"]["device_shards"] <= plan["budget"]["allowed"]
    assert [a["name"] for a in plan["alternatives"]] == ["zero2-offload-all", "zero3-offload-all", "rcache-max", "rcache-min"]
    assert doc["profile"]["ac_regions"] == 12 and doc["profile"]["tied"] == ["transformer.wte.weight"]
    assert set(doc["timings"]) == {"build_s", "profile_s", "search_s"}


def test_the_issue_example_prints_tables_and_a_png(capsys, hardware, tmp_path) -> None:
    png = tmp_path / "plan.png"
    code, out, _ = _run(capsys, "--model", "gpt2-10b", "--seq-len", "1024", "--batch-size", "8", "--gpus", "2",
                        "--gpu-mem", "80GiB", "--host-mem", "256GiB", "--hardware", hardware, "--plot", str(png))
    assert code == 0
    for section in ("== profile ==", "== plan ==", "== alternatives", "predicted step", "zero3-offload-all", "profiled in"):
        assert section in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_file_and_underscore_flags(capsys, hardware, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                                  "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 1000}))
    code, out, _ = _run(capsys, "--model_config", str(config), "--gpu_mem", "1GiB", "--host_mem", "8GiB",
                        "--seq_len", "128", "--batch_size", "2", "--hardware", hardware, "--no-ac", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["profile"]["ac_regions"] == 0 and doc["plan"]["n_chunks"] > 0


def test_nothing_fits_exits_2_with_the_numbers(capsys, hardware) -> None:
    code, _, err = _run(capsys, "--model", "gpt2-xl", "--gpu-mem", "8GiB", "--host-mem", "4GiB", "--hardware", hardware)
    assert code == 2
    assert "no plan fits" in err and "U_allowed" in err and "To make it fit" in err


def test_opt_175b_profile_and_search_times(capsys, hardware) -> None:
    code, out, _ = _run(capsys, "--model", "opt-175b", "--seq-len", "2048", "--batch-size", "1", "--gpus", "2",
                        "--gpu-mem", "80GiB", "--host-mem", "4TiB", "--hardware", hardware, "--json")
    assert code == 0
    timings = json.loads(out)["timings"]
    assert timings["profile_s"] < 5 and timings["search_s"] < 10, timings
