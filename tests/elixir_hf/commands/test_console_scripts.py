"""Every console script of pyproject.toml says its version, and its ``--help`` and ``--version`` load
neither torch nor transformers (a fraction of a second, not the 6-10 s they took: issue 50, 5); bad input
to one is a message naming the fix: ``--plot`` without matplotlib (an extra: ``elixir-hf[plot]``), a
checkpoint folder that is not there."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import elixir_hf

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _main(entry: str):
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_says_its_version(script: str, capsys) -> None:
    try:
        _main(SCRIPTS[script])(["--version"])
    except SystemExit as exit:
        assert exit.code in (0, None)
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{script} ") and out.endswith(f" {elixir_hf.__version__}"), out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_and_version_load_neither_torch_nor_transformers(script: str) -> None:
    module, name = SCRIPTS[script].split(":")
    code = (
        f"import sys\nfrom {module} import {name} as main\nfor flag in ('--help', '--version'):\n"
        "    try:\n        main([flag])\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stderr.strip() == "[]", out.stderr
    assert out.stdout.startswith(f"usage: {script}") and f" {elixir_hf.__version__}\n" in out.stdout


def test_plan_help_names_are_the_engine_s() -> None:
    """``elixir-plan``'s help lists the cards and moments without importing the engine (``names.py``)."""
    from elixir_hf.commands.plan import names
    from elixir_runtime import MOMENTS
    from elixir_runtime.hardware import REFERENCE, SHIPPED

    assert (names.CARDS, names.REFERENCE, names.MOMENTS) == (SHIPPED, REFERENCE, MOMENTS)


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    with pytest.raises(SystemExit) as exit:
        _main(SCRIPTS["elixir-plan"])(["--model", "gpt2", "--plot", str(tmp_path / "plan.png")])
    assert exit.value.code == 1  # plan.EXIT_INPUT
    assert "--plot" in (err := capsys.readouterr().err) and "pip install 'elixir-hf[plot]'" in err
    assert not (tmp_path / "plan.png").exists()


def test_convert_names_a_missing_checkpoint_folder(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit:
        _main(SCRIPTS["elixir-convert"])([str(tmp_path / "checkpoint-9"), str(tmp_path / "out")])
    assert exit.value.code == 2
    assert "checkpoint-9: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
