"""The rule that picks the tests ``make test`` runs again on transformers 5.17 (``-m transformers``):
it must not leave out a test that reaches transformers code (helpers/transformers_use.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.transformers_use import HF_PACKAGES, ROOT, TESTS, uses_transformers


def _uses(folder: Path, source: str, **others: str) -> bool:
    for name, text in others.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    test = folder / "test_case.py"
    test.write_text(textwrap.dedent(source))
    uses_transformers.cache_clear()
    return uses_transformers(test)


@pytest.mark.parametrize(
    "source, others",
    [
        ("def test():\n    import huggingface_hub\n", {}),  # an import inside a function counts
        ("from helpers.training import run_elixir\n", {}),  # through helpers.training → .models (relative)
        ("from tests.helpers.models import tiny_gpt2\n", {}),
        ("import importlib\nimportlib.import_module('transformers.models.gpt2')\n", {}),
        ("CMD = ['-m', 'accelerate.commands.launch']\n", {}),
        ("from elixir_hf.plugin import ElixirPlugin\n", {}),  # elixir_hf/__init__ runs first and imports transformers
        ("from cases import make\n", {"cases.py": "from datasets import Dataset\n"}),  # a module of the test's folder
        ("run_script('worker.py')\n", {"worker.py": "from transformers import Trainer\n"}),  # a script it launches
        ("SCRIPTS = Path(__file__).with_name('scripts')\n", {"scripts/sft.py": "import trl\n"}),  # a folder of scripts
        # a script that finds a module of another tests/ folder through a sys.path edit (reliability/nodes_worker.py)
        ("run_script('worker.py')\n", {"worker.py": "sys.path.insert(0, HERE)\nfrom hf_cases import make_trainer\n"}),
    ],
)
def test_reaching_an_hf_package_marks_the_module(tmp_path, source, others) -> None:
    assert _uses(tmp_path, source, **others)


def test_engine_only_modules_stay_unmarked(tmp_path) -> None:
    assert not _uses(tmp_path, "import torch\nimport elixir_runtime as er\nfrom helpers.dist import run_distributed\n")
    assert not _uses(tmp_path, "run_script('worker.py')\n", **{"worker.py": "import torch.distributed\n"})


def test_every_hf_glue_test_is_marked() -> None:
    modules = sorted((TESTS / "elixir_hf").rglob("test_*.py"))
    assert modules and all(uses_transformers(m) for m in modules), [m.name for m in modules if not uses_transformers(m)]


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_unmarked_modules_import_no_hf_package() -> None:
    """What Python itself imports for every unmarked test module holds none of HF_PACKAGES (a check of
    the static rule by the import machinery, the way pytest imports them)."""
    unmarked = [p for p in sorted(TESTS.rglob("test_*.py")) if not uses_transformers(p)]
    assert unmarked  # the split saves something
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.path[:0] = [{str(TESTS)!r}, {str(ROOT)!r}, {str(ROOT / "src")!r}]
        for i, path in enumerate({[str(p) for p in unmarked]!r}):
            sys.path.insert(0, path.rsplit("/", 1)[0])
            spec = importlib.util.spec_from_file_location(f"unmarked_{{i}}", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({sorted(HF_PACKAGES)!r})))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", (out.stdout, [p.name for p in unmarked])
