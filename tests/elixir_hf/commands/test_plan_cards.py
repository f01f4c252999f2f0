"""``elixir-plan --gpu NAME``: a card planned for without owning it, in its profile's host unless
``--host-mem`` says otherwise; this machine's RAM only beside this machine's GPU."""

from __future__ import annotations

import json

import pytest
import torch

from elixir_hf.commands.plan import hardware as plan_hardware
from elixir_hf.commands.plan import main
from elixir_runtime.hardware import load_hardware
from elixir_runtime.hardware.load import SHIPPED, shipped_hardware
from elixir_runtime.hardware.profile import PROFILE_VERSION

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


def _plan(capsys, *argv: str) -> tuple[str, dict]:
    """The text and the JSON document of one plan."""
    assert main(list(argv)) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return text, json.loads(capsys.readouterr().out)


def test_a_card_not_owned_plans_in_its_profiles_host(capsys) -> None:
    """The issue's example: the header names the card, where its profile comes from, the host
    memory and whose it is."""
    assert main(["--model", "llama3-8b", "--seq-len", "256", "--batch-size", "1", "--gpu", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert (
        "GPU:  NVIDIA A100-SXM4-80GB, 79.53 GiB; --gpu a100-80gb: derived from the shipped h100 profile and the "
        "card's published figures" in out
    )
    host_gib = shipped_hardware("h100").host_memory / GIB
    assert (
        f"host: {host_gib:.2f} GiB RAM, the profile's host's (the h100 box the profile derives from: 126 GiB, 16 cores for 1 GPU"
        in out
    )
    assert "predicted step:" in out


def test_a_foreign_card_never_takes_this_machines_ram_unless_asked(capsys, tiny) -> None:
    """No GPU here: the shipped card's host memory (not this machine's 12 GiB), however the card
    is named; ``--host-mem here`` and ``--host-mem SIZE`` on request, the CPU rates still the profile's."""
    profile_host = load_hardware("h100").host_memory
    for flags in ((), ("--gpu", "h100"), ("--hardware", "h100")):
        out, doc = _plan(capsys, *tiny, *flags)
        assert doc["plan"]["budget"]["host_capacity"] == doc["host"]["memory"] == profile_host, flags
        assert "the profile's host's (the machine the profile was measured on: 126 GiB, 16 cores for 1 GPU" in out, (
            flags
        )
    out, doc = _plan(capsys, *tiny, "--gpu", "l40s", "--host-mem", "here")
    assert doc["plan"]["budget"]["host_capacity"] == 12 * GIB
    assert "host: 12.00 GiB RAM, available on this machine (--host-mem here), CPU Adam rates for 16 cores" in out
    out, doc = _plan(capsys, *tiny, "--gpu", "l40s", "--host-mem", "64GiB")
    assert doc["plan"]["budget"]["host_capacity"] == 64 * GIB and "as given (--host-mem)" in doc["host"]["source"]
    assert doc["hardware"]["device"] == "NVIDIA L40S" and doc["plan"]["search"]["hardware"]["device"] == "NVIDIA L40S"


def test_this_machines_gpu_plans_with_this_machines_ram(tiny, tmp_path, monkeypatch) -> None:
    """Its cached profile (measured here) and the RAM available here, what prepare budgets with."""
    import elixir_runtime.hardware.load as load
    from elixir_hf.commands.plan import _parser
    from elixir_hf.commands.plan.hardware import host_memory, plan_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no plan is made: nothing runs on it
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(load, "machine_key", lambda: "here")
    mine = shipped_hardware("h100")
    mine.source, mine.version = "measured on this test's machine", PROFILE_VERSION  # current: not measured again
    mine.cpu_adam8 = dict(mine.cpu_adam)  # nor its 8-bit CPU Adam, which the shipped profile lacks
    mine.save(load.cache_path())
    args = _parser().parse_args(tiny)
    hardware, note = plan_hardware(args)
    assert hardware.source == mine.source and note == ""  # the header: "this machine's GPU (measured on ...)"
    assert host_memory(args, hardware) == (12 * GIB, "available on this machine")
    args = _parser().parse_args([*tiny, "--gpu", "h200"])
    assert host_memory(args, plan_hardware(args)[0])[0] == mine.host_memory


@pytest.mark.parametrize("flag", ["--gpu", "--hardware"])
def test_an_unknown_card_is_one_message_naming_the_fix(capsys, tiny, flag) -> None:
    assert main([*tiny, flag, "a200"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"elixir-plan: {flag} a200: 'a200' is no card")
    assert ", ".join(SHIPPED) in err and "--measure-hardware hw.json" in err and "--hardware hw.json" in err


def test_a_gpu_memory_beyond_the_named_card_is_refused(capsys, tiny) -> None:
    assert main([*tiny, "--gpu", "h100", "--gpu-mem", "500GiB"]) == 1
    err = capsys.readouterr().err
    assert "--gpu-mem 500.00 GiB is more than the 79.18 GiB of --gpu h100: drop --gpu-mem" in err
    assert "give at most 80 GiB" in err
    assert main([*tiny, "--gpu", "h100", "--gpu-mem", "80GiB", "--json"]) == 0  # the card's size as it is said


def test_a_sequence_beyond_the_learned_positions_is_refused(capsys, tiny) -> None:
    """GPT-2's positions are an embedding's rows (``n_positions`` 256 here). Before: planned in silence; the
    run's first forward fails indexing them."""
    assert main([*tiny, "--gpu", "h100", "--seq-len", "257"]) == 1
    assert capsys.readouterr().err == (
        f"elixir-plan: --seq-len 257 is more than the 256 positions --model {tiny[1]} learns (its config's "
        "max_position_embeddings): a run's first forward fails indexing them; give --seq-len 256 or less, or a "
        "config with more positions\n"
    )
    assert main([*tiny, "--gpu", "h100", "--seq-len", "256", "--json"]) == 0


def test_a_batch_whose_hidden_states_exceed_the_gpu_is_refused_before_its_profile(capsys, tiny) -> None:
    """Before: ``--batch-size 1000000000`` profiled for hours (the loss's row blocks, a billion tokens)."""
    assert main([*tiny, "--gpu", "h100", "--batch-size", "1000000000"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "elixir-plan: --batch-size 1000000000 x --seq-len 128: 128000000000 tokens per GPU, whose hidden states alone "
        "(one layer's output, 128 values a token) take 30517.58 GiB, more than the GPU's 79.18 GiB: lower"
    )
    capped = [*tiny, "--gpu", "h100", "--gpu-memory", "4MiB"]  # the cap, where given: 16384 tokens of 256 bytes
    assert main([*capped, "--batch-size", "129"]) == 1
    assert (
        "(one layer's output, 128 values a token) take 4.03 MiB, more than the GPU's 4.00 MiB"
        in capsys.readouterr().err
    )
    assert main([*capped, "--batch-size", "128"]) == 2  # profiled: no plan fits


def test_help_lists_the_cards(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    plain = " ".join(capsys.readouterr().out.split())
    assert f"--gpu NAME plan for this card without owning it: {', '.join(SHIPPED)}" in plain
