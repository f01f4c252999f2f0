"""The ``elixir-plan`` figures the docs quote, regenerated from ``elixir-plan`` itself (no GPU needed).

    PYTHONPATH=src python -m benchmarks.doc_numbers --check     # exit 1 with a diff of each quote that differs
    PYTHONPATH=src python -m benchmarks.doc_numbers --write     # rewrite them

A quote sits between ``<!-- elixir-plan: NAME -->`` and ``<!-- /elixir-plan -->`` in a file of ``DOCS``:
a figure inline (``NAME`` is ``PLAN:COLUMN``: ``COLUMNS[COLUMN]`` of the plan ``PLANS[PLAN]``), or a
table on the lines between (``NAME`` a key of ``TABLES``: its header, and per row the plan and the
cells, with ``{COLUMN}`` where a figure goes and the measured cells written by hand; or the biggest
model per box, ``benchmarks.biggest_model``'s). Every plan is made offline for the shipped H100 profile
with ``--host-mem`` given (``BOX``): nothing of this machine enters; plans of one model and batch
profile its step once (``PROFILES``). tests/benchmarks/test_doc_numbers.py compares every quote with
``elixir-plan``'s output, in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import io
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import biggest_model
from elixir_hf.commands.plan import main as elixir_plan
from elixir_hf.commands.plan.report import Profiles

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "recipes/sft/README.md", "docs/which-knob.md", "docs/planning.md")
"""The files whose quotes this script keeps."""
GIB = 2**30
BOX = ("--gpu", "h100", "--host-mem", "128GiB", "--seq-len", "2048")
"""What every quoted plan is made for: the shipped H100 profile and a 128 GiB host, sequences of 2048 tokens."""

QUOTE = re.compile(r"<!-- elixir-plan: (?P<name>[\w.:=-]+) -->(?P<quoted>.*?)<!-- /elixir-plan -->", re.S)


CARDS = ("a100-40gb", "a100-80gb", "h100", "h200", "l40s", "rtx4090")
"""The cards of docs/planning.md's table of derived profiles."""


def _plan_args(model: str, batch: int = 8, accum: int = 1, gpus: int = 1, *more: str) -> tuple[str, ...]:
    return (*BOX, "--model", model, "--batch-size", str(batch), "--grad-accum", str(accum), "--gpus", str(gpus), *more)


PLANS: dict[str, tuple[str, ...]] = {
    **{f"llama-b{b}": _plan_args("llama3.1-8b", b) for b in (2, 4, 8, 16)},
    **{f"llama-b{b}x{a}": _plan_args("llama3.1-8b", b, a) for b, a in ((4, 2), (4, 4), (8, 4))},
    "llama-b8-60GiB": _plan_args("llama3.1-8b", 8, 1, 1, "--gpu-memory", "60GiB"),
    "llama-2gpu": _plan_args("llama3.1-8b", gpus=2),
    "qwen7-b8": _plan_args("qwen2.5-7b"),
    "qwen7-2gpu": _plan_args("qwen2.5-7b", gpus=2),
    "mistral-b8": _plan_args("mistral-7b-v0.3"),
    "mistral-2gpu": _plan_args("mistral-7b-v0.3", gpus=2),
    "qwen14-b8": _plan_args("qwen2.5-14b"),
    "qwen14-b4": _plan_args("qwen2.5-14b", 4),
    "qwen14-2gpu": _plan_args("qwen2.5-14b", gpus=2),
    "qwen14-4gpu": _plan_args("qwen2.5-14b", gpus=4),
    **{f"qwen14-192GiB-b{b}": (*_plan_args("qwen2.5-14b", b), "--host-mem", "192GiB") for b in (4, 8)},
    "qwen14-h200-b4": (*_plan_args("qwen2.5-14b", 4), "--gpu", "h200"),
    "readme": (*_plan_args("llama3-8b", 4), "--gpu-mem", "80GiB", "--host-mem", "256GiB"),
    # each card with its profile's host (the H100 box's), as `elixir-plan --gpu NAME` plans for it
    **{
        f"card-{card}": ("--gpu", card, "--seq-len", "2048", "--model", "llama3-8b", "--batch-size", "4")
        for card in CARDS
    },
}
"""The quoted plans by name: ``elixir-plan``'s arguments."""


PROFILES: Profiles = {}
"""The steps profiled so far: the plans of one model and batch for other boxes profile it once."""


@functools.cache
def plan_doc(argv: tuple[str, ...]) -> dict[str, Any]:
    """``elixir-plan ARGV --json``'s document, in this process (``{"error": ...}`` where no plan fits)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        elixir_plan([*argv, "--json"], profiles=PROFILES)
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


def _plan(doc: dict[str, Any]) -> dict[str, Any]:
    plan: dict[str, Any] = doc["plan"]
    return plan


def share(doc: dict[str, Any]) -> str:
    """The offloaded chunks' share of the model's elements (of its training state)."""
    p = _plan(doc)
    numel = [c["numel"] for c in p["chunks"]]
    return f"{100 * sum(numel[i] for i in p['offload']) / sum(numel):.0f} %"


def offloaded(doc: dict[str, Any], first: bool) -> str:
    """``46 of 131 chunks (36 %)`` (``first``), else ``46 (36 %)``; ``none``."""
    p = _plan(doc)
    if not p["offload"]:
        return "none"
    n = len(p["offload"])
    return f"{n} of {p['n_chunks']} chunks ({share(doc)})" if first else f"{n} ({share(doc)})"


def _hardware(doc: dict[str, Any]) -> dict[str, Any]:
    """The hardware profile the plan was made with (``HardwareProfile.to_dict``)."""
    hardware: dict[str, Any] = _plan(doc)["search"]["hardware"]
    return hardware


def _pinned(doc: dict[str, Any]) -> int:
    """Pinned host memory per GPU: the offloaded chunks and the held block inputs."""
    memory = _plan(doc)["memory"]
    return int(memory["host_shards"] + memory.get("host_activations", 0))


def pinned(doc: dict[str, Any]) -> str:
    """Pinned host memory per GPU, and for both GPUs of a 2-GPU host; ``–``: none."""
    per_gpu, ranks = _pinned(doc), _plan(doc)["budget"]["ranks_per_host"]
    if not per_gpu:
        return "–"
    return f"{per_gpu / GIB:.1f} GiB" + (f" ({per_gpu * ranks / GIB:.1f} for both)" if ranks == 2 else "")


def _tflops(doc: dict[str, Any], seconds: float) -> str:
    """8 x parameters x tokens per step / the step (``plan_view.tflops``)."""
    b, s = _plan(doc)["batch_shape"]
    return f"{8 * doc['profile']['parameters'] * b * s * doc['settings']['grad_accum'] / seconds / 1e12:.0f}"


def _zero2(doc: dict[str, Any]) -> float:
    alt = next(a for a in _plan(doc)["alternatives"] if a["name"] == "zero2-offload-all")
    total: float = alt["time"]["total"]
    return total


_NO_FIT = {
    "state": re.compile(r"The model states take (\S+) GiB in all"),
    "host_fits": re.compile(r"= (\S+) GiB of pinned host memory per rank"),
    "host_needed": re.compile(r"host RAM of at least (\S+) GiB"),
}


def _no_fit(doc: dict[str, Any], what: str) -> float:
    found = _NO_FIT[what].search(doc["error"])
    assert found, f"the no-fit message no longer says {_NO_FIT[what].pattern}: {doc['error']}"
    return float(found[1])


COLUMNS: dict[str, Callable[[dict[str, Any]], str]] = {
    "offloaded": lambda d: offloaded(d, first=True),
    "offloaded_short": lambda d: offloaded(d, first=False),
    "n_offloaded": lambda d: str(len(_plan(d)["offload"])),
    "n_chunks": lambda d: str(_plan(d)["n_chunks"]),
    "share": share,
    "tokens": lambda d: (
        f"{round(d['settings']['batch_size'] * d['settings']['seq_len'] * d['settings']['grad_accum'] / 1000)} k"
    ),
    "activations": lambda d: f"{_plan(d)['memory']['activations'] / GIB:.1f} GiB",
    "cpu_adam": lambda d: f"{_plan(d)['predicted']['exposed_cpu_adam']:.2f} s",
    "compute": lambda d: f"{_plan(d)['predicted']['compute']:.2f} s",
    "step": lambda d: f"{_plan(d)['predicted']['total']:.2f} s",
    "tflops": lambda d: _tflops(d, _plan(d)["predicted"]["total"]),
    "zero2_step": lambda d: f"{_zero2(d):.2f} s",
    "zero2_tflops": lambda d: _tflops(d, _zero2(d)),
    "pinned": pinned,
    "pinned_per_gpu": lambda d: f"{_pinned(d) / GIB:.1f} GiB",
    "gpu": lambda d: f"{sum(v for k, v in _plan(d)['memory'].items() if not k.startswith('host')) / GIB:.1f} GiB",
    "params": lambda d: f"{d['profile']['parameters'] / 1e9:.2f} B",
    "offloaded_of": lambda d: (
        f"{len(_plan(d)['offload'])} of {_plan(d)['n_chunks']}" if _plan(d)["offload"] else "none"
    ),
    "step_3": lambda d: f"{_plan(d)['predicted']['total']:.3f} s",
    # the profile the plan was made with (the card's, shipped or derived)
    "matmul": lambda d: f"{_hardware(d)['matmul']['8192'] / 1e12:.0f}",
    "attention": lambda d: f"{max(_hardware(d)['attention'].values()) / 1e12:.0f}",
    "bandwidth": lambda d: f"{_hardware(d)['memory_bandwidth'] / 1e12:.2f}",
    "gpu_adam": lambda d: f"{_hardware(d)['gpu_adam'] / 1e9:.0f}",
    "copies_up": lambda d: f"{_hardware(d)['links']['1']['c2g'] / 1e9:.1f}",
    "gpu_memory": lambda d: f"{_hardware(d)['gpu_memory'] / GIB:.2f}",
    "state": lambda d: f"{_no_fit(d, 'state'):.0f} GiB",
    "host_fits": lambda d: f"{_no_fit(d, 'host_fits'):.1f} GiB",
    "host_needed": lambda d: f"{_no_fit(d, 'host_needed'):.1f} GiB",
}
"""A quoted figure by its name: its text from the plan's ``--json`` document (or, for ``state``,
``host_fits`` and ``host_needed``, from the message of a plan that does not fit)."""


MEASURED_OVER = "measured_over"
"""``PLAN:measured_over=SECONDS``: a measured step (written by hand) over the plan's predicted one."""


def figure(name: str) -> str:
    """``PLAN:COLUMN``'s text, or ``PLAN:measured_over=SECONDS``'s."""
    plan, _, column = name.partition(":")
    column, _, measured = column.partition("=")
    if plan not in PLANS or (column not in COLUMNS and not (column == MEASURED_OVER and measured)):
        raise KeyError(
            f"<!-- elixir-plan: {name} -->: a PLAN:COLUMN of {sorted(PLANS)} and {sorted(COLUMNS)}, or "
            f"PLAN:{MEASURED_OVER}=SECONDS"
        )
    doc = plan_doc(PLANS[plan])
    if column == MEASURED_OVER:
        return f"{float(measured) / _plan(doc)['predicted']['total']:.2f}"
    return COLUMNS[column](doc)


@dataclass(frozen=True)
class Table:
    """A quoted table: its header lines, then per row a plan's name and its cells (``{COLUMN}``: a figure)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, tuple[str, ...]], ...]

    def text(self) -> str:
        lines = list(self.header)
        for plan, cells in self.rows:
            doc = plan_doc(PLANS[plan])
            lines.append("| " + " | ".join(c.format_map(_Figures(doc)) for c in cells) + " |")
        return "\n".join(lines)


@dataclass(frozen=True)
class Biggest:
    """A quoted table of the biggest model per box (``benchmarks.biggest_model.table``)."""

    boxes: tuple[tuple[int, int], ...]
    """(H100s, host RAM in GiB) per row."""
    brief: bool = False

    def text(self) -> str:
        return "\n".join(biggest_model.table([_biggest(*box) for box in self.boxes], self.brief))


@functools.cache
def _biggest(gpus: int, host_gib: int) -> dict[str, Any]:
    return biggest_model.biggest(gpus, host_gib, PROFILES)


class _Figures(dict[str, str]):
    """``COLUMNS`` of one plan, computed where a cell names them (``str.format_map``)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__()
        self.doc = doc

    def __missing__(self, column: str) -> str:
        return COLUMNS[column](self.doc)


def _batch_row(batch: int, accum: int, measured: str, first: bool = False) -> tuple[str, tuple[str, ...]]:
    label = str(batch) if accum == 1 else f"{batch} × {accum}"
    offload = "{offloaded}" if first else "{offloaded_short}"
    cells = (label, "{tokens}", offload, "{activations}", "{cpu_adam}", "{step}", "{tflops}", measured)
    return f"llama-b{batch}" + (f"x{accum}" if accum > 1 else ""), cells


_RECIPES = (  # plan, recipe (its parameters on its first row), GPUs, the measured step (docs/benchmarks.md)
    ("llama-b8", "`llama3.1-8b` ({params})", 1, "**2.21 s, 476 TFLOPS** (47 of 131 offloaded; 2.42 s predicted)"),
    ("llama-2gpu", "`llama3.1-8b`", 2, "not run"),
    ("qwen7-b8", "`qwen2.5-7b` ({params})", 1, "**1.99 s, 502 TFLOPS** (37 of 115; 2.14 s predicted)"),
    ("qwen7-2gpu", "`qwen2.5-7b`", 2, "not run"),
    ("qwen14-b8", "`qwen2.5-14b` (14.77 B)", 1, ""),
    (
        "qwen14-2gpu",
        "`qwen2.5-14b`",
        2,
        "not on H100s: on 2 × **H200** (141 GB, 252 GiB host; the lent 2-GPU machine came with H200s) **3.78 s, 512 "
        "TFLOPS** with nothing offloaded (195 chunks; 4.23 s predicted, 0.90)",
    ),
    ("mistral-b8", "`mistral-7b-v0.3` ({params})", 1, "**2.02 s, 469 TFLOPS** (18 of 66; 2.33 s predicted)"),
    ("mistral-2gpu", "`mistral-7b-v0.3`", 2, "not run"),
)
_NO_FIT_CELLS = (
    "no plan fits: {state} of training state, {host_fits} of it fits the host; needs {host_needed} of host RAM or a "
    "second GPU",
    "–",
    "–",
    "–",
    "–",
)


def _card_row(card: str, first: bool) -> tuple[str, tuple[str, ...]]:
    units = (" TFLOPS", "", " TB/s", " G/s", " GB/s", " GiB") if first else ("",) * 6
    figures = ("matmul", "attention", "bandwidth", "gpu_adam", "copies_up", "gpu_memory")
    cells = (f"`{card}`", *(f"{{{f}}}{u}" for f, u in zip(figures, units, strict=True)), "{offloaded_of}, {step_3}")
    return f"card-{card}", cells


TABLES: dict[str, Table | Biggest] = {
    "biggest": Biggest(biggest_model.BOXES),
    "biggest-brief": Biggest(((1, 128), (1, 512), (4, 256)), brief=True),
    "cards": Table(
        (
            "| `--gpu` | matmul 8192 | attention | memory bandwidth | GPU Adam | copies up (1 GPU) | GPU memory | "
            "Llama-3-8B: offloaded chunks, predicted step |",
            "|---|---|---|---|---|---|---|---|",
        ),
        tuple(_card_row(card, first=i == 0) for i, card in enumerate(CARDS)),
    ),
    "which-knob-batch": Table(
        (
            "| batch × accumulation | tokens / step | offloaded | activations | CPU Adam not hidden | predicted step | "
            "predicted TFLOPS | measured (Llama-3-8B) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ),
        (
            _batch_row(2, 1, "–", first=True),
            _batch_row(4, 1, "367–401"),
            _batch_row(8, 1, "464–482"),
            _batch_row(16, 1, "–"),
            _batch_row(4, 2, "–"),
            _batch_row(4, 4, "–"),
            _batch_row(8, 4, "–"),
        ),
    ),
    "sft-recipes": Table(
        (
            "| recipe | GPUs | batch × seq / GPU | offloaded | pinned host / GPU | predicted step | predicted TFLOPS / GPU "
            "| measured step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ),
        tuple(
            (
                plan,
                (recipe, str(gpus), "8 × 2048")
                + (_NO_FIT_CELLS if not measured else ("{offloaded}", "{pinned}", "{step}", "{tflops}", measured)),
            )
            for plan, recipe, gpus, measured in _RECIPES
        ),
    ),
}
"""The quoted tables by name."""


def expected(name: str) -> str:
    """What the quote ``name`` should say: a table's lines (between blank lines), or a figure."""
    return f"\n{TABLES[name].text()}\n\n" if name in TABLES else figure(name)


def quotes(text: str) -> list[re.Match[str]]:
    """The quotes in a file's text."""
    return list(QUOTE.finditer(text))


def regenerated(text: str) -> str:
    """``text`` with every quote as ``elixir-plan`` says it now."""
    return QUOTE.sub(lambda m: f"<!-- elixir-plan: {m['name']} -->{expected(m['name'])}<!-- /elixir-plan -->", text)


def stale(path: str, root: Path = ROOT) -> str:
    """A diff of ``path``'s quotes against ``elixir-plan``'s figures; empty where they agree."""
    text = (root / path).read_text()
    diff = difflib.unified_diff(
        text.splitlines(), regenerated(text).splitlines(), f"{path} (quoted)", "elixir-plan", lineterm="", n=0
    )
    return "\n".join(diff)


def write(path: str, root: Path = ROOT) -> bool:
    """Rewrites ``path``'s quotes with ``elixir-plan``'s figures; whether any changed."""
    text = (root / path).read_text()
    new = regenerated(text)
    (root / path).write_text(new)
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.doc_numbers", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 where a quote differs, with the diff")
    mode.add_argument("--write", action="store_true", help="rewrite every quote")
    args = p.parse_args(argv)
    if args.write:
        for path in DOCS:
            print(f"{path}: {'rewritten' if write(path) else 'unchanged'}")
        return 0
    diffs = [d for d in map(stale, DOCS) if d]
    print("\n\n".join(diffs) if diffs else f"the quotes of {', '.join(DOCS)} agree with elixir-plan")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
