"""The import graph of the two packages: layers point one way and nothing imports in a circle.

Parsed with ``ast`` (nothing is imported), so a lazy import inside a function counts too: it is
the same dependency, only hidden. Every module must be placed in ``LAYERS``; a new one fails here
until it is, which is the moment to decide where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: list[tuple[str, ...]] = [
    # what the user asks for, and facts of this host (its memory, the GPU memory this process may use);
    # the progress bars' protocol (no bars unless a caller installs a factory)
    ("elixir_runtime.config", "elixir_runtime.host", "elixir_runtime.gpu_limit", "elixir_runtime.progress"),
    # the model as the planner and the engine see it: fetch units, parameter table
    ("elixir_runtime.units",),
    # chunk layout and the memory, copies and collectives of chunks
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
    # the plan and the planner that decides it (profile, search, layout) for prepare and elixir-plan
    ("elixir_runtime.plan", "elixir_runtime.planner"),
    ("elixir_runtime.api", "elixir_runtime.compile", "elixir_runtime"),
    ("elixir_hf",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
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


def test_layers_are_stated_by_folder() -> None:
    """A layer names whole packages (or top-level modules): no file of a folder sits in another layer."""
    modules = _modules()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    split = [p for layer in LAYERS for p in layer if p.rsplit(".", 1)[0] in packages - {"elixir_runtime", "elixir_hf"}]
    assert not split, f"layers name files inside a package: {split}"
