"""The import graph of the two packages and the benchmarks over them: layers point one way, nothing
imports in a circle, and ``elixir_hf`` reaches the engine through its public faces only.

Parsed with ``ast`` (nothing is imported), so a lazy import inside a function counts too: it is
the same dependency, only hidden. Every module must be placed in ``LAYERS``; a new one fails here
until it is, which is the moment to decide where it belongs, and until docs/architecture.md names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGES = {"elixir_runtime": SRC, "elixir_hf": SRC, "benchmarks": ROOT}
"""Each top-level package of the graph and the folder it sits in."""

LAYERS: list[tuple[str, ...]] = [
    # what the user asks for, and facts of this host (its memory, the GPU memory this process may use);
    # the progress bars' protocol (no bars unless a caller installs a factory)
    (
        "elixir_runtime.config",
        "elixir_runtime.adam_state",
        "elixir_runtime.host",
        "elixir_runtime.gpu_limit",
        "elixir_runtime.progress",
    ),
    # the model as the planner and the engine see it: fetch units, parameter table
    ("elixir_runtime.units",),
    # the plumbing between ranks: chunk collectives, check-ins, a rank's failure, heartbeats
    ("elixir_runtime.distributed",),
    # where the starting weights come from: each rank's, rank 0's, files, the model's init
    ("elixir_runtime.weights",),
    # chunk layout and the memory and copies of chunks
    ("elixir_runtime.chunk",),
    # Adam kernels (torch, C++, Triton) and their thread counts
    ("elixir_runtime.kernels",),
    # the engine: chunk residency and gradients, hooks, the update lanes of offloaded chunks
    ("elixir_runtime.runtime",),
    # what the user holds on top of the engine: the optimizer, the model's state-dict hooks
    ("elixir_runtime.optim", "elixir_runtime.state_dict"),
    # measuring the machine and the model's step
    ("elixir_runtime.hardware", "elixir_runtime.profiler"),
    # the cost model and the search over plans; it reads the engine's constants, never the reverse
    ("elixir_runtime.search",),
    # the plan, its one renderer, and the planner that decides it (profile, search, layout) for prepare and elixir-plan
    ("elixir_runtime.plan", "elixir_runtime.plan_view", "elixir_runtime.planner"),
    ("elixir_runtime.api", "elixir_runtime.compile", "elixir_runtime"),
    # elixir_hf, bottom up. Its reach into the libraries (patches.py: every private name it relies on), what a
    # run asks (the plugin) and checks at launch, the console, the loss and presets, a rank's run record
    (
        "elixir_hf.patches",
        "elixir_hf.plugin",
        "elixir_hf.launch",
        "elixir_hf.mixin",
        "elixir_hf.console",
        "elixir_hf.presets",
        "elixir_hf.loss",
        "elixir_hf.timing",
        "elixir_hf.run_record",
    ),
    # what a user's files say: the JSON Schema of --elixir, the elixir key of a YAML config
    ("elixir_hf.schema", "elixir_hf.config_file"),
    # files: the checkpoint format (markers, optimizer files, locks, conversion), models loaded without a host copy
    ("elixir_hf.checkpoint", "elixir_hf.loading"),
    # the engine under the HF objects: built from a plugin, its optimizer's wrapper and its numbers
    ("elixir_hf.engine", "elixir_hf.optimizer", "elixir_hf.metrics"),
    # what the Trainer and the Accelerator are made of: the batch planned for, the arguments, the frozen
    # reference, generation, preemption, the callbacks and the run's report against its plan
    (
        "elixir_hf.batch_plan",
        "elixir_hf.arguments",
        "elixir_hf.reference",
        "elixir_hf.generate",
        "elixir_hf.preemption",
        "elixir_hf.run_report",
        "elixir_hf.callback",
    ),
    # the HF objects on the engine
    ("elixir_hf.accelerator", "elixir_hf.trainer"),
    # the package's public face (its names imported on first use)
    ("elixir_hf",),
    # plugins for training frontends (Axolotl's): the Trainer and its arguments under their hooks
    ("elixir_hf.integrations",),
    # the command lines: they parse arguments and call in; nothing of the package imports them
    ("elixir_hf.commands",),
    # the throughput harness and the measurements over the packages
    ("benchmarks",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for f in (root / package).rglob("*.py"):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
                if node.level
                else node.module
            )
            for alias in node.names:
                full = f"{base}.{alias.name}"
                deps.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
    return {d for d in deps if d in modules and d != name}


PLACED_BY_NAME = ("elixir_runtime", "elixir_hf")
"""Packages whose every module (or folder) is placed by name: their own entry in ``LAYERS`` is their
``__init__`` (the public face) only, so a new module fails ``_layer`` until it is placed."""


def _layer(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            below = name.startswith(p + ".") and p not in PLACED_BY_NAME
            if (name == p or below) and p.count(".") > depth:
                best, depth = i, p.count(".")
    assert best is not None, f"{name} is in no layer of tests/test_layers.py: place it"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down() -> None:
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in _graph().items()
        for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle a depth-first walk of ``graph`` closes, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(cycles)


def _folder(name: str, packages: set[str]) -> str:
    """The folder ``name`` sits in (a package is its own folder); a module at a package's top is its own."""
    folder = name if name in packages else name.rsplit(".", 1)[0]
    return name if folder in PACKAGES else folder


def _folder_graph(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for m, deps in graph.items():
        here = _folder(m, packages)
        folders.setdefault(here, set()).update(f for d in deps if (f := _folder(d, packages)) != here)
    return folders


def test_no_folder_import_cycles() -> None:
    """Folders (``hardware/``, ``profiler/``, ``commands/``...) import each other one way only: a module of
    one importing the other's while some module of the other imports the first's is a cycle, even
    where no module-level cycle closes."""
    modules = _modules()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    cycles = _cycles(_folder_graph(_graph(), packages))
    assert not cycles, "folders importing each other:\n" + "\n".join(cycles)


def test_the_folder_check_sees_a_cycle() -> None:
    """Two folders each with a module importing the other's (no module imports in a circle)."""
    graph = {
        "elixir_runtime.hardware.measure": {"elixir_runtime.profiler.costs"},
        "elixir_runtime.profiler.costs": {"elixir_runtime.hardware.profile"},
        "elixir_runtime.hardware.profile": set(),
    }
    assert not _cycles(graph)
    packages = {"elixir_runtime", "elixir_runtime.hardware", "elixir_runtime.profiler"}
    assert _cycles(_folder_graph(graph, packages)) == [
        "elixir_runtime.hardware -> elixir_runtime.profiler -> elixir_runtime.hardware"
    ]
    assert _folder("elixir_runtime.config", packages) == "elixir_runtime.config"  # a top-level module: its own


def test_nothing_is_imported_for_its_effect() -> None:
    """Importing a module defines names and runs nothing else: no call at a module's top level (what
    should happen is called where it is needed), no import kept only for what importing it does."""
    found = []
    for name, path in sorted(_modules().items()):
        if path.name == "__main__.py" or name.split(".")[0] == "benchmarks":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and "noqa: F401" in lines[node.lineno - 1]:
                found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not found, "\n".join(found)


def test_the_checker_sees_imports() -> None:
    """The parser resolves relative and lazy imports (a checker that sees none passes vacuously)."""
    graph = _graph()
    assert "elixir_runtime.hardware.measure" in graph["elixir_runtime.hardware.load"]  # `from . import measure`
    assert "elixir_runtime.plan" in graph["elixir_runtime.api"]
    assert "elixir_runtime.chunk.layout" in graph["elixir_runtime.search.loop"]
    assert "benchmarks.hf_systems" in graph["benchmarks.systems"]  # lazy, inside a function
    assert "elixir_hf.run_report" in graph["elixir_hf.callback"]
    assert "elixir_hf.commands.plan.run" in graph["elixir_hf.commands.plan"]  # `from .run import`, lazy


def test_layers_are_stated_by_folder() -> None:
    """A layer names whole packages (or top-level modules): no file of a folder sits in another layer."""
    modules = _modules()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    split = [p for layer in LAYERS for p in layer if p.rsplit(".", 1)[0] in packages - set(PACKAGES)]
    assert not split, f"layers name files inside a package: {split}"


RUNTIME_FACES = (
    "elixir_runtime",  # the engine: prepare, the optimizer, weights left in their files, state by name
    "elixir_runtime.config",  # what a run asks of it
    "elixir_runtime.planner",  # plans, without a GPU (elixir-plan)
    "elixir_runtime.plan_view",  # a plan's one renderer: the log table, elixir-plan's sections, the metrics
    "elixir_runtime.hardware",  # the machine: its profile, memory, cores, Adam kernels
    "elixir_runtime.progress",  # the progress bars' protocol
)
"""The modules ``elixir_hf`` may import ``elixir_runtime`` through, and of each only the names in its
``__all__``: what the engine keeps behind them can change without the HF layer noticing."""


def _public(path: Path) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__: a public face says what it exports")


def _runtime_uses(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of each use of ``elixir_runtime`` in ``path``: ``from M import name``,
    ``import M`` (name ``None``), and ``M.name`` on a name bound by ``import M``."""
    tree = ast.parse(path.read_text())
    uses, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "elixir_runtime":
            uses += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "elixir_runtime":
                    uses.append((node.lineno, alias.name, None))
                    bound[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            uses.append((node.lineno, bound[node.value.id], node.attr))
    return uses


def test_elixir_hf_reaches_the_engine_through_its_faces() -> None:
    modules = _modules()
    public = {face: _public(modules[face]) for face in RUNTIME_FACES}
    past = []
    for name, path in sorted(modules.items()):
        if name.split(".")[0] != "elixir_hf":
            continue
        for line, module, used in _runtime_uses(path):
            if module not in public:
                past.append(f"{name}:{line} imports {module}, not a face ({', '.join(RUNTIME_FACES)})")
            elif used is not None and used not in public[module]:
                past.append(f"{name}:{line} uses {module}.{used}, not in its __all__")
    assert not past, "export what elixir_hf needs from a face of tests/test_layers.py:\n" + "\n".join(past)


def test_the_checker_sees_runtime_uses() -> None:
    uses = _runtime_uses(SRC / "elixir_hf" / "engine.py")
    assert {("elixir_runtime", None), ("elixir_runtime", "prepare"), ("elixir_runtime", "ElixirOptimizer")} <= {
        (module, used) for _, module, used in uses
    }


def test_the_architecture_doc_names_every_module() -> None:
    """docs/architecture.md stays the map of ``src/``: every module is named there, and every ``*.py``
    it names exists (in ``src/``, ``benchmarks/``, ``recipes/`` or ``tests/``)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for p in SRC.rglob("*.py") if p.name != "__init__.py"]
    unnamed = sorted(str(p.relative_to(SRC)) for p in modules if p.name not in doc)
    assert not unnamed, f"docs/architecture.md does not name {unnamed}: add each where its folder is drawn"
    files = {p.name for folder in ("src", "benchmarks", "recipes", "tests") for p in (ROOT / folder).rglob("*.py")}
    gone = sorted(set(re.findall(r"\b([a-z_0-9]+\.py)\b", doc)) - files)
    assert not gone, f"docs/architecture.md names {gone}, which no longer exist"
