"""``elixir-plan`` for any box (issue 50, 3): loose card names, a mistyped preset refused before any Hub
call, the 24-72 B presets, a multi-GPU plan on another machine's profile saying the host it assumed,
``--host-cores``, and the warning when a plan pins most of the host's RAM."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from elixir_hf.commands.plan import EXIT_INPUT, main
from elixir_hf.commands.plan import hardware as plan_hardware
from elixir_hf.commands.plan.report import build_meta_model, host_warnings, model_config
from elixir_runtime.hardware import load_hardware

GIB = 2**30
TINY = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 256}


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> list[str]:
    """A tiny model's flags, on a machine without a GPU whose available RAM is 12 GiB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ELIXIR_HARDWARE", raising=False)
    monkeypatch.setattr(plan_hardware, "host_available", lambda: 12 * GIB)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return ["--model", str(path), "--seq-len", "128", "--batch-size", "2"]


@pytest.mark.parametrize(
    ("written", "card"),
    [("rtx-4090", "rtx4090"), ("RTX 4090", "rtx4090"), ("nvidia-h100", "h100"), ("A100_80GB", "a100-80gb")],
)
def test_a_card_name_is_matched_however_it_is_written(written: str, card: str) -> None:
    assert plan_hardware.card_name(written) == card
    assert plan_hardware.card_name("a200") == "a200"  # unknown: left for the message listing the cards


def test_a_card_alias_plans(capsys, tiny) -> None:
    assert main([*tiny, "--gpu", "rtx-4090", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["device"] == load_hardware("rtx4090").device


def test_a_mistyped_preset_is_refused_before_any_hub_call(capsys, tiny, monkeypatch) -> None:
    """No 25 s of Hub retries: a name without owner/ is looked up in the local cache only."""
    from transformers import AutoConfig

    calls: list[dict] = []

    def from_pretrained(name, **kwargs):
        calls.append(kwargs)
        raise OSError(f"{name} not cached")

    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    assert main([*tiny[:0], "--model", "llama3-70b", "--gpu", "h100"]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert calls == [{"local_files_only": True}]
    assert "--model llama3-70b: no preset" in err and "did you mean llama3.1-70b" in err and "qwen2.5-72b" in err
    with pytest.raises(ValueError, match="not a preset, a config.json, or a Hub id"):
        model_config("someone/some-model", 128)  # owner/name: the Hub after the cache
    assert calls[1:] == [{"local_files_only": True}, {}]


PUBLISHED = {  # parameters of each model card's config.json, in billions
    "mistral-small-24b": 23.572,
    "gemma2-27b": 27.227,
    "qwen2.5-32b": 32.764,
    "llama3.1-70b": 70.554,
    "qwen2.5-72b": 72.706,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_24_to_72b_presets_have_their_published_sizes(name: str) -> None:
    model = build_meta_model(model_config(name, 1024), torch.bfloat16, checkpointing=False)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(PUBLISHED[name], abs=1e-3)
    assert model_config(name.upper().replace("-", "_"), 1024).model_type == model.config.model_type


def _host(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_more_gpus_than_the_profile_had_scale_its_host_and_say_so(capsys, tiny) -> None:
    """8 GPUs on the 1-GPU h100 box's profile: 8 such hosts' RAM and cores, said; given values win."""
    profile = load_hardware("h100")
    doc = _host(capsys, *tiny, "--gpu", "h100", "--gpus", "8")
    assert doc["host"]["memory"] == doc["plan"]["budget"]["host_capacity"] == 8 * profile.host_memory
    assert doc["host"]["source"].startswith("ASSUMED: 8 GPUs x the profile host's RAM and cores per GPU")
    assert f"{8 * profile.cpu_cores} cores; --host-mem SIZE and --host-cores N" in doc["host"]["source"]
    doc = _host(capsys, *tiny, "--gpu", "h100", "--gpus", "8", "--host-mem", "2TiB", "--host-cores", "112")
    assert doc["host"]["memory"] == 2048 * GIB
    assert doc["host"]["source"] == "as given (--host-mem), CPU Adam rates for 112 cores (--host-cores)"
    doc = _host(capsys, *tiny, "--gpu", "h100", "--gpus", "1")
    assert doc["host"]["memory"] == profile.host_memory and "ASSUMED" not in doc["host"]["source"]


def test_host_cores_price_each_rank_at_the_profiles_rate_for_its_cores() -> None:
    profile = load_hardware("h100")  # 16 cores, CPU Adam measured for one rank
    one = profile.cpu_adam[1].under_copies

    def per_rank(gpus: int, cores: int | None) -> float:
        args = argparse.Namespace(gpu="h100", hardware=None, gpus=gpus, host_cores=cores)
        return plan_hardware.host_hardware(args, profile).rates(gpus).cpu_adam

    assert per_rank(8, None) == pytest.approx(one)  # 8 boxes' cores: 16 a rank, as measured
    assert per_rank(8, 16) == pytest.approx(one / 8)  # the profile's host shared by 8
    assert per_rank(8, 32) == pytest.approx(one / 4)
    assert per_rank(1, 64) == pytest.approx(one)  # never above what one rank ran at


def test_a_plan_pinning_over_90_percent_of_the_host_warns() -> None:
    def plan(pinned_gib: float, host_gib: float, ranks: int = 1) -> SimpleNamespace:
        budget = SimpleNamespace(ranks_per_host=ranks, host_capacity=int(host_gib * GIB))
        return SimpleNamespace(host_bytes=int(pinned_gib * GIB), budget=budget)

    assert host_warnings(plan(100, 121.6)) == []
    (warning,) = host_warnings(plan(119.7, 121.6))  # the desktop
    assert warning.startswith("the plan pins 119.70 GiB of the host's 121.60 GiB RAM (98%): 1.90 GiB is left")
    assert "--host-mem" in warning
    assert host_warnings(plan(30, 121.6, ranks=4))  # every GPU's pinned memory counts


def test_the_warning_is_on_stderr_and_in_the_json(capsys, tiny, monkeypatch) -> None:
    from elixir_hf.commands.plan import report as plan_report

    monkeypatch.setattr(plan_report, "HOST_PINNED_WARN", -1.0)  # any plan warns
    assert main([*tiny, "--gpu", "h100"]) == 0
    out, err = capsys.readouterr()
    assert "WARNING: the plan pins" in err and "WARNING" not in out
    assert main([*tiny, "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"][0].startswith("the plan pins")


def test_help_gives_the_exit_codes(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    plain = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 a plan; 1 bad input" in plain and "2 no plan fits" in plain and "--host-cores N" in plain
