"""The biggest Llama-shaped model a box can train, by ``elixir-plan`` (no GPU needed).

    PYTHONPATH=src python -m benchmarks.biggest_model [--gpus 1 2 4] [--host 128 256 512] [--json]

For each number of H100s (the shipped profile) and host RAM, the largest of the Llama presets
(``SHAPES``) that ``elixir-plan`` fits, with its plan's pinned host memory per GPU and predicted step; batch 4 x 2048 per GPU, bf16, activation checkpointing, clipping.
A host of N GiB is planned with N - ``OS_GIB`` available to the job (``--host-mem``: the memory
available before the model is loaded; docs/planning.md, "Host memory"). The tables of README
and docs/planning.md ("The biggest model") are ``table``'s, kept by ``benchmarks.doc_numbers``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Sequence

from elixir_hf.commands.plan import main as elixir_plan
from elixir_hf.commands.plan.report import Profiles

OS_GIB = 3
"""What a host of N GiB keeps from the job (kernel, services): 128 GiB machines show ~125 GiB MemTotal."""

SHAPES = ("llama3-8b", "llama2-13b", "codellama-34b", "llama2-70b")
"""Presets (``elixir_hf.presets``: the published configs' shapes), smallest first."""

BOXES = tuple((gpus, host) for gpus in (1, 2, 4) for host in (128, 256, 512))
"""(H100s, host RAM in GiB) of docs/planning.md's table."""


def plan(model: str, gpus: int, host_gib: int, profiles: Profiles | None = None) -> dict | None:
    """``elixir-plan --json``'s document, ``None`` where nothing fits; ``profiles``: as ``elixir-plan``'s."""
    out = io.StringIO()
    argv = ["--model", model, "--seq-len", "2048", "--batch-size", "4", "--gpus", str(gpus)]
    argv += ["--hardware", "h100", "--host-mem", f"{host_gib - OS_GIB}GiB", "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = elixir_plan(argv, profiles=profiles)
    doc = json.loads(out.getvalue())
    return doc if code == 0 else None


def biggest(gpus: int, host_gib: int, profiles: Profiles | None = None) -> dict:
    """The largest shape that fits, tried from the largest down (a shape fits where a larger one does);
    ``profiles``: the steps profiled for other boxes (a shape's step is the same on every box)."""
    for name in reversed(SHAPES):
        doc = plan(name, gpus, host_gib, profiles)
        if doc is not None:
            p = doc["plan"]
            return {
                "gpus": gpus,
                "host_GiB": host_gib,
                "model": name,
                "params_B": round(doc["profile"]["parameters"] / 1e9, 2),
                "pinned_host_GiB_per_gpu": round(p["memory"]["host_shards"] / 2**30, 1),
                "offloaded": f"{len(p['offload'])}/{p['n_chunks']}",
                "predicted_step_s": round(p["predicted"]["total"], 2),
            }
    return {"gpus": gpus, "host_GiB": host_gib, "model": None}


def table(rows: Sequence[dict], brief: bool = False) -> list[str]:
    """``biggest``'s rows as a Markdown table; ``brief``: without the parameters and offloaded chunks (README's)."""
    if brief:
        lines = ["| H100s | host RAM | biggest model | pinned host / GPU | predicted step |", "|---|---|---|---|---|"]
    else:
        lines = [
            "| H100s | host RAM | biggest model | params | pinned host / GPU | offloaded chunks | predicted step |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        box = [str(r["gpus"]), f"{r['host_GiB']} GiB"]
        if r["model"] is None:
            cells = [*box, "none of these", *([""] * (2 if brief else 4))]
        elif brief:
            model = f"`{r['model']}` ({r['params_B']} B)"
            cells = [*box, model, f"{r['pinned_host_GiB_per_gpu']} GiB", f"{r['predicted_step_s']} s"]
        else:
            size, pinned = f"{r['params_B']} B", f"{r['pinned_host_GiB_per_gpu']} GiB"
            cells = [*box, r["model"], size, pinned, r["offloaded"], f"{r['predicted_step_s']} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--host", type=int, nargs="+", default=[128, 256, 512], help="host RAM, GiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profiles: Profiles = {}
    rows = [biggest(g, h, profiles) for g in args.gpus for h in args.host]
    print(json.dumps(rows, indent=2) if args.json else "\n".join(table(rows)))


if __name__ == "__main__":
    main()
