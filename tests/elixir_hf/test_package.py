"""``elixir_hf/__init__.py``: the public names resolve on first use, and the modules that do not need
the Trainer stack (``elixir-plan``, the lean loss, the harness's workers) do not import it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import elixir_hf


def test_every_public_name_resolves_to_its_module() -> None:
    for name in elixir_hf.__all__:
        value = getattr(elixir_hf, name)
        assert value.__name__ == name and value.__module__.startswith("elixir_hf."), (name, value)
    assert set(elixir_hf.__all__) <= set(dir(elixir_hf))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="ElixirTrainerr"):
        elixir_hf.ElixirTrainerr  # noqa: B018


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_the_planner_cli_and_the_loss_do_not_import_the_trainer_stack() -> None:
    code = (
        "import sys, elixir_hf.commands.plan, elixir_hf.loss, elixir_hf.presets; "
        "print(sorted(m for m in ('transformers.trainer', 'accelerate', 'peft', 'elixir_hf.trainer') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_version_is_pyproject_s(capsys: pytest.CaptureFixture) -> None:
    import tomllib
    from pathlib import Path

    from elixir_hf.commands import plan

    version = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert elixir_hf.__version__ == version
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"elixir-plan {version}"


# Imported but not declared, with why: triton comes with a CUDA torch (its pin; the dev extra for the CPU tests),
# pyarrow with datasets, wandb is the user's reporter (callback.RunRecorder reports to it where the run does), yaml
# (PyYAML) comes with TRL, whose --config files elixir-run reads where it imports; axolotl is the user's frontend
# (its plugin imports it where Axolotl loads it; no release installs beside the supported transformers yet).
UNDECLARED = {"triton", "pyarrow", "wandb", "yaml", "axolotl"}
# Declared but not imported: ninja is the build tool torch.utils.cpp_extension runs for the C++ CPU Adam.
UNIMPORTED = {"ninja"}


def test_every_imported_package_is_declared_and_every_declared_one_imported() -> None:
    """The third-party packages src/ imports (anywhere: lazy imports count) against pyproject.toml's
    dependencies and extras (issue 50: filelock, huggingface_hub and tqdm were imported undeclared,
    tokenizers declared and never imported)."""
    import ast
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    first_party = {"elixir_hf", "elixir_runtime"}
    imported: set[str] = set()
    for path in (root / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {canonicalize_name(m) for m in imported - first_party - set(sys.stdlib_module_names)}
    core = {canonicalize_name(Requirement(d).name) for d in project["dependencies"]}
    extras = {canonicalize_name(Requirement(d).name) for ds in project["optional-dependencies"].values() for d in ds}
    assert third_party - core - extras - UNDECLARED == set(), "imported, not declared"
    assert core - third_party - UNIMPORTED == set(), "declared, never imported"
