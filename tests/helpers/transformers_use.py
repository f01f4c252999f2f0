"""Which test modules run transformers code: ``make test`` runs the whole suite on the newest
transformers, then again on 5.17 (the GPU image's) only the tests marked ``transformers``
(``tests/conftest.py`` marks them from this rule), less the tests of this repository's own code
(``once``: the engine's, the fault handling's and the benchmark harness's), whose transformers code the
HF layer's tests run on 5.17 too. An engine-only test runs the same code under
both versions, so its second run could catch nothing the first did not (265 of 744 tests, but
only about 55 s of an 8.5-minute pass: most time goes to tests that train transformers models).

The rule is static and errs towards marking: a module uses transformers if its source, or any
file of this repository it reaches, imports a package in ``HF_PACKAGES`` (at the top or inside a
function) or names one in a string (``importlib.import_module``, ``-m accelerate.commands.launch``).
A file is reached through an import that resolves to a file of the repository (``tests/helpers``,
``hf_cases``, ``benchmarks``, ``src/elixir_hf``; a name that is neither there nor installed: every
tests/ file of that name, as a worker script that edits ``sys.path`` finds it), or through a string
naming a ``.py`` file or a folder next to it or under ``tests/`` (a worker script run under torchrun,
``with_name("scripts")``).
``tests/test_transformers_split.py`` checks the rule, and that the unmarked modules import none of
these packages when Python imports them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

HF_PACKAGES = frozenset({"transformers", "huggingface_hub", "accelerate", "datasets", "peft", "trl"})
"""transformers and huggingface_hub (both replaced by the 5.17 overlay) and the packages built on them."""

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
_IMPORT_ROOTS = (TESTS, ROOT, ROOT / "src")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_PATHLIKE = re.compile(r"[\w.-]+(/[\w.-]+)*")


def _module_files(name: str, folder: Path, imported: bool) -> list[Path]:
    """The repository files ``import name`` runs from a module in ``folder``: the module and its parent
    packages' ``__init__.py`` (pytest puts a test's own folder on the path, as do tests/, the root and src/)."""
    parts = name.split(".")
    for root in (folder, *_IMPORT_ROOTS):
        base = root.joinpath(*parts)
        module = next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)
        if module is not None:
            inits = (root.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts)))
            return [module, *(f for f in inits if f.is_file())]
    top_found = any(
        (root / parts[0]).is_dir() or (root / f"{parts[0]}.py").is_file() for root in (folder, *_IMPORT_ROOTS)
    )
    if not imported or top_found or not parts[0] or parts[0].startswith("__"):  # found, or `from pkg import name`
        return []
    spec = importlib.util.find_spec(parts[0])
    if spec is None or spec.origin is None or Path(spec.origin).resolve().is_relative_to(TESTS):
        # not installed: a tests/ module found through a sys.path edit (or a test folder pytest put on the path)
        return [f for f in TESTS.rglob("*.py") if parts[0] in (f.stem, f.parent.name)]
    return []


@functools.cache
def _references(path: Path) -> tuple[bool, set[Path]]:
    """(imports or names an HF package itself, the repository .py files it reaches)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    strings: set[str] = set()
    reached: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package folder
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                stem = ".".join(p for p in (node.module or "").split(".") if p)
                rel = base.joinpath(*stem.split(".")) if stem else base
                files = {rel.with_suffix(".py"), rel / "__init__.py", *(rel / f"{a.name}.py" for a in node.names)}
                reached.update(f for f in files if f.is_file())
            else:
                names.add(node.module or "")
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    if any(n.split(".")[0] in HF_PACKAGES for n in names | {s for s in strings if _DOTTED.fullmatch(s)}):
        return True, set()
    for name in names:
        reached.update(_module_files(name, path.parent, imported=True))
    for name in {s for s in strings if _DOTTED.fullmatch(s)}:  # "-m elixir_hf.commands.run", import_module(...)
        reached.update(_module_files(name, path.parent, imported=False))
    for s in strings:
        if not _PATHLIKE.fullmatch(s) or s.strip(".") == "":
            continue
        for target in (path.parent / s, TESTS / s):
            if target.is_file() and target.suffix == ".py":
                reached.add(target)
            elif target.is_dir() and target.resolve() not in (TESTS, ROOT):
                reached.update(target.rglob("*.py"))
    return False, {p.resolve() for p in reached}


@functools.cache
def uses_transformers(path: Path) -> bool:
    """True if ``path`` or a repository file it reaches (transitively) imports an HF package."""
    seen: set[Path] = set()
    todo = [Path(path).resolve()]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        direct, reached = _references(current)
        if direct:
            return True
        todo.extend(reached - seen)
    return False
