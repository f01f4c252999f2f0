"""The biggest Llama-shaped model a box can train, by ``elixir-plan`` (no GPU needed).

    PYTHONPATH=src python -m benchmarks.biggest_model [--gpus 1 2 4] [--host 128 256 512] [--json]

For each number of H100s (the shipped profile) and host RAM, the largest of the known Llama
shapes (``SHAPES``, smallest first) that ``elixir-plan`` fits, with its plan's pinned host memory
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
import tempfile
from pathlib import Path

from elixir_hf.cli import main as elixir_plan

OS_GIB = 3
"""What a host of N GiB keeps from the job (kernel, services): 128 GiB machines show ~125 GiB MemTotal."""

_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}
SHAPES = {  # name: LlamaConfig fields (the published configs' shapes)
    "Llama-3-8B": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "Llama-2-13B": {
        **_LLAMA2,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "intermediate_size": 13824,
    },
    "CodeLlama-34B": {
        **_LLAMA2,
        "hidden_size": 8192,
        "num_hidden_layers": 48,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 22016,
    },
    "Llama-2-70B": {
        **_LLAMA2,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
    },
}


def plan(config: Path, gpus: int, host_gib: int) -> dict | None:
    """``elixir-plan --json``'s document, ``None`` where nothing fits."""
    out = io.StringIO()
    argv = ["--model", str(config), "--seq-len", "2048", "--batch-size", "4", "--gpus", str(gpus)]
    argv += ["--hardware", "h100", "--host-mem", f"{host_gib - OS_GIB}GiB", "--json"]
    with contextlib.redirect_stdout(out):
        code = elixir_plan(argv)
    doc = json.loads(out.getvalue())
    return doc if code == 0 else None


def biggest(configs: dict[str, Path], gpus: int, host_gib: int) -> dict:
    """The largest shape that fits (shapes grow, so the first refusal ends the search)."""
    best: dict = {"gpus": gpus, "host_GiB": host_gib, "model": None}
    for name, path in configs.items():
        doc = plan(path, gpus, host_gib)
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
    with tempfile.TemporaryDirectory() as tmp:
        configs = {}
        for name, fields in SHAPES.items():
            configs[name] = Path(tmp, f"{name}.json")
            configs[name].write_text(json.dumps({"model_type": "llama", **fields}))
        rows = [biggest(configs, g, h) for g in args.gpus for h in args.host]
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
