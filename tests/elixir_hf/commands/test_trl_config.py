"""TRL's YAML config (``--config file.yaml``, read by ``TrlParser``) and its ``elixir`` key.

In code, ``elixir_args(DPOConfig)`` (or ``SFTConfig``) among ``TrlParser``'s dataclasses has the
``elixir`` field: the YAML key is honoured, a strict parser accepts it, and ``--elixir`` on the command
line beats it, as TRL ranks every key. Through ``elixir-run`` the script's parser holds the stock
classes: elixir-run reads the key itself (after its own ``--elixir``, before ``ELIXIR_CONFIG``) and
takes it out of what the parser sees (``patches.config_key_taken``), so a strict parser does not refuse it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

from elixir_hf import elixir_args
from elixir_hf.commands.run import chosen_spec, config_file_elixir

SCRIPT = Path(__file__).with_name("scripts") / "trl_parse.py"
SRC = Path(__file__).parents[3] / "src"


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "dpo.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbeta: 0.25\n{text}")
    return str(path)


def test_the_key_in_code_through_elixir_args(tmp_path) -> None:
    config = _yaml(tmp_path, "elixir:\n  mode: static\n  offload: 0.5\n")
    parser = TrlParser((ScriptArguments, elixir_args(DPOConfig), ModelConfig))
    _, args, _ = parser.parse_args_and_config(["--config", config], fail_with_unknown_args=True)
    assert args.elixir_plugin is not None and args.elixir_plugin.config.offload == 0.5 and args.beta == 0.25
    _, args, _ = parser.parse_args_and_config(["--config", config, "--elixir", "off"])  # the command line wins
    assert args.elixir_plugin is None and args.beta == 0.25


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("elixir:\n  offload: 0.5\n", '{"offload": 0.5}'),
        ("elixir: auto\n", "auto"),
        ("elixir: off\n", "off"),  # YAML 1.1 reads off as false
        ("elixir: true\n", "auto"),
        ("elixir: plan.json\n", "plan.json"),
        ("elixir:\n", None),  # null: as if absent
        ("", None),
    ],
)
def test_the_key_as_elixir_run_reads_it(tmp_path, text: str, spec: str | None) -> None:
    config = _yaml(tmp_path, text)
    got = config_file_elixir(["dpo.py", "--lr", "1", "--config", config])
    assert got == (None if spec is None else (f"{config}'s elixir", spec))


def test_no_config_file_or_an_unreadable_one_leaves_it_to_the_script(tmp_path) -> None:
    assert config_file_elixir(["dpo.py", "--config"]) is None
    assert config_file_elixir(["dpo.py", "--config", str(tmp_path / "missing.yaml")]) is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("elixir: [unclosed\n")
    assert config_file_elixir(["dpo.py", "--config", str(bad)]) is None


def _elixir_run(*args: str) -> dict:
    """``python -m elixir_hf.commands.run trl_parse.py ARGS``: what its arguments held."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "elixir_hf.commands.run", str(SCRIPT), *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return _parsed(proc.stdout)


def _parsed(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("PARSED ")).removeprefix("PARSED "))


def test_elixir_runs_flag_beats_the_key_which_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    in_config = ("x.yaml's elixir", '{"offload": 0.5}')
    monkeypatch.setenv("ELIXIR_CONFIG", "off")
    assert chosen_spec("auto", in_config) == ("--elixir", "auto")
    assert chosen_spec(None, in_config) == in_config
    assert chosen_spec(None, None) == ("ELIXIR_CONFIG", "off")
    monkeypatch.delenv("ELIXIR_CONFIG")
    assert chosen_spec(None, None) == ("ELIXIR_CONFIG", "auto")


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_elixir_run_honours_the_key_under_a_strict_parser(tmp_path) -> None:
    config = _yaml(tmp_path, "elixir:\n  mode: static\n  offload: 0.5\n")
    got = _elixir_run("--config", config)  # fail_with_unknown_args=True: the key is not left to it
    assert got == {"class": "ElixirDPOConfig", "elixir": True, "offload": 0.5, "beta": 0.25}


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("elixir:\n  ofload: 0.5\n", "unknown {}'s elixir key 'ofload' \\(did you mean 'offload'\\?\\)"),
        ("elixir: '{\"offload\": 0.5'\n", "{}'s elixir is not valid JSON"),
        ("elixir: [0.5]\n", "{}'s elixir '\\[0.5\\]' is not understood"),
        ("elixir: 0.5\n", "{}'s elixir '0.5' is not understood"),
        ("elixir: {offload: half}\n", "{}'s elixir: ElixirConfig.offload must be"),
    ],
)
def test_a_bad_value_in_the_file_stops_elixir_run_naming_the_file(tmp_path, text: str, refusal: str) -> None:
    from elixir_hf.commands.run import main

    config = _yaml(tmp_path, text)
    with pytest.raises(SystemExit, match="elixir-run: " + refusal.format(re.escape(config))):
        main([sys.executable, "--config", config])


def test_in_code_the_keys_yaml_booleans_are_auto_and_off(tmp_path) -> None:
    parser = TrlParser((ScriptArguments, elixir_args(DPOConfig), ModelConfig))
    for word, on in (("true", True), ("yes", True), ("off", False), ("no", False)):
        _, args, _ = parser.parse_args_and_config(["--config", _yaml(tmp_path, f"elixir: {word}\n")])
        assert (args.elixir_plugin is not None) is on, word


def test_an_accelerate_config_with_the_key_is_refused_by_accelerate_naming_key_and_file(tmp_path) -> None:
    """Accelerate reads its config before any script (elixir-run included) runs, and refuses a key it does not
    know: Elixir's settings go on the script's command line or in ELIXIR_CONFIG (recipes/elixir.yaml says so)."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate.yaml"
    path.write_text((Path(__file__).parents[3] / "recipes" / "elixir.yaml").read_text() + "elixir: auto\n")
    with pytest.raises(
        ValueError, match=rf"The config file at {re.escape(str(path))} had unknown keys \(\['elixir'\]\)"
    ):
        load_config_from_file(str(path))
