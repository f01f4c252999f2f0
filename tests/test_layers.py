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
    ("elixir_hf",),
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


def _layer(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and p.count(".") > depth:
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


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_imports() -> None:
    """The parser resolves relative and lazy imports (a checker that sees none passes vacuously)."""
    graph = _graph()
    assert "elixir_runtime.hardware.measure" in graph["elixir_runtime.hardware.load"]  # `from . import measure`
    assert "elixir_runtime.plan" in graph["elixir_runtime.api"]
    assert "elixir_runtime.chunk.layout" in graph["elixir_runtime.search.loop"]
    assert "benchmarks.hf_systems" in graph["benchmarks.systems"]  # lazy, inside a function


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
