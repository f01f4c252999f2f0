"""The biggest Llama-shaped model a box can train, by ``elixir-plan`` (no GPU needed).

    PYTHONPATH=src python -m benchmarks.biggest_model [--gpus 1 2 4] [--host 128 256 512] [--json]

For each number of H100s (the shipped profile) and host RAM, the largest of the Llama presets
(``SHAPES``, smallest first) that ``elixir-plan`` fits, with its plan's pinned host memory
per GPU and predicted step; batch 4 x 2048 per GPU, bf16, activation checkpointing, clipping.
A host of N GiB is planned with N - ``OS_GIB`` available to the job (``--host-mem``: the memory
available before the model is loaded; docs/planning.md, "Host memory"). The table in
docs/planning.md ("The biggest model") is this script's output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from elixir_hf.commands.plan import main as elixir_plan

OS_GIB = 3
"""What a host of N GiB keeps from the job (kernel, services): 128 GiB machines show ~125 GiB MemTotal."""

SHAPES = ("llama3-8b", "llama2-13b", "codellama-34b", "llama2-70b")
"""Presets (``elixir_hf.presets``: the published configs' shapes), smallest first."""


def plan(model: str, gpus: int, host_gib: int) -> dict | None:
    """``elixir-plan --json``'s document, ``None`` where nothing fits."""
    out = io.StringIO()
    argv = ["--model", model, "--seq-len", "2048", "--batch-size", "4", "--gpus", str(gpus)]
    argv += ["--hardware", "h100", "--host-mem", f"{host_gib - OS_GIB}GiB", "--json"]
    with contextlib.redirect_stdout(out):
        code = elixir_plan(argv)
    doc = json.loads(out.getvalue())
    return doc if code == 0 else None


def biggest(gpus: int, host_gib: int) -> dict:
    """The largest shape that fits (shapes grow, so the first refusal ends the search)."""
    best: dict = {"gpus": gpus, "host_GiB": host_gib, "model": None}
    for name in SHAPES:
        doc = plan(name, gpus, host_gib)
        if doc is None:
            break
        p = doc["plan"]
        best = {
            "gpus": gpus,
            "host_GiB": host_gib,
            "model": name,
            "params_B": round(doc["profile"]["parameters"] / 1e9, 2),
            "pinned_host_GiB_per_gpu": round(p["memory"]["host_shards"] / 2**30, 1),
            "offloaded": f"{len(p['offload'])}/{p['n_chunks']}",
            "predicted_step_s": round(p["predicted"]["total"], 2),
        }
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--host", type=int, nargs="+", default=[128, 256, 512], help="host RAM, GiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [biggest(g, h) for g in args.gpus for h in args.host]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| H100s | host RAM | biggest model | params | pinned host / GPU | offloaded chunks | predicted step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["model"] is None:
            print(f"| {r['gpus']} | {r['host_GiB']} GiB | none of these | | | | |")
            continue
        print(
            f"| {r['gpus']} | {r['host_GiB']} GiB | {r['model']} | {r['params_B']} B | "
            f"{r['pinned_host_GiB_per_gpu']} GiB | {r['offloaded']} | {r['predicted_step_s']} s |"
        )


if __name__ == "__main__":
    main()
