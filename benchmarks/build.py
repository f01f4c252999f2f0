"""How long building the engine on a saved model takes, and the host memory it needs, per rank.

    python -m benchmarks.build write --model llama3-8b --dtype bf16 --out /data/llama3-8b   # random weights, saved once
    torchrun --nproc_per_node 4 -m benchmarks.build run --folder /data/llama3-8b --dtype bf16
    torchrun --nproc_per_node 4 -m benchmarks.build run --folder /data/llama3-8b --dtype bf16 --no-stream
    python -m benchmarks.build arenas --gib 100 [--no-huge-pages]   # the host arenas' fill and pinning alone

``run`` times ``elixir_hf.from_pretrained`` (streamed: every rank on meta; ``--no-stream``: rank 0
reads the weights, the others on meta) and ``elixir_runtime.prepare`` (the plan and the fill of
the chunk shards) and prints one JSON line on rank 0: ``load_s``, ``prepare_s``, ``build_s`` and per
rank the peak RSS (``VmHWM``; it includes the pinned shards the plan keeps on the host)
and the RSS before loading, plus the host's peak used memory (sampled) and the plan's host bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from .hostmem import GIB, HostMemorySampler, peak_rss_bytes, rss_bytes
from .models import build_meta, enable_checkpointing, materialize, preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def write(args: argparse.Namespace) -> None:
    """A random-init checkpoint of ``--model`` in ``--dtype``, as ``save_pretrained`` writes it."""
    fill = "cuda" if torch.cuda.is_available() else "cpu"
    model = materialize(build_meta(preset(args.model), dtype=DTYPES[args.dtype]), "cpu", fill)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    print(json.dumps({"folder": args.out, "params": sum(p.numel() for p in model.parameters())}))


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    import elixir_hf
    import elixir_runtime as er

    distributed = "RANK" in os.environ
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    rss_start = rss_bytes()
    sampler = HostMemorySampler().start()
    sampler.reset()
    t0 = time.perf_counter()
    model = elixir_hf.from_pretrained(
        AutoModelForCausalLM, args.folder, stream=args.stream, dtype=DTYPES[args.dtype], attn_implementation="sdpa"
    )
    enable_checkpointing(model)
    t1 = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ids = torch.zeros(args.batch_size, args.seq, dtype=torch.long, device=device)
    config = er.ElixirConfig(**json.loads(args.elixir))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, _ = er.prepare(model, optimizer, config, {"input_ids": ids, "labels": ids})
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    sampler.stop()
    mine = {"rss_peak_GiB": peak_rss_bytes() / GIB, "rss_start_GiB": rss_start / GIB}
    everyone = [mine] * world
    if distributed:
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        plan = model._elixir.plan
        record = {
            "folder": args.folder,
            "stream": args.stream,
            "world_size": world,
            "load_s": t1 - t0,
            "prepare_s": t2 - t1,
            "build_s": t2 - t0,
            "rss_peak_per_rank_GiB": [r["rss_peak_GiB"] for r in everyone],
            "rss_start_per_rank_GiB": [r["rss_start_GiB"] for r in everyone],
            "host_used_peak_GiB": sampler.peak_used / GIB,
            "plan_host_shards_per_rank_GiB": plan.memory.host_shards / GIB,
        }
        print(json.dumps(record))
    if distributed:
        dist.destroy_process_group()


def arenas(args: argparse.Namespace) -> None:
    """Seconds to fill (first touch, chunk by chunk, as the engine's fill) and pin ``--gib`` of host
    arena, on huge pages (``empty_arena``, the engine's) or not (``--no-huge-pages``)."""
    from elixir_runtime.chunk.host_memory import empty_arena, pin_host

    n = int(args.gib * GIB) // 4
    t0 = time.perf_counter()
    t = empty_arena(n, torch.float32) if args.huge_pages else torch.empty(n, dtype=torch.float32)
    step = 2**26  # 256 MiB, about one chunk shard
    for i in range(0, n, step):
        t[i : i + step].zero_()
    t1 = time.perf_counter()
    pin_host(t)
    t2 = time.perf_counter()
    print(json.dumps({"gib": args.gib, "huge_pages": args.huge_pages, "fill_s": t1 - t0, "pin_s": t2 - t1}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.build", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="save a random-init checkpoint of a preset or config")
    w.add_argument("--model", required=True, help="a preset (llama3-8b, ...), a config.json or a model folder")
    w.add_argument("--dtype", choices=DTYPES, default="bf16")
    w.add_argument("--out", required=True)
    w.add_argument("--max-shard-size", default="5GB")
    r = sub.add_parser("run", help="time from_pretrained + prepare (under torchrun for several ranks)")
    r.add_argument("--folder", required=True)
    r.add_argument("--dtype", choices=DTYPES, default="bf16")
    r.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--batch-size", type=int, default=4)
    r.add_argument("--seq", type=int, default=2048)
    r.add_argument("--elixir", default="{}", help='ElixirConfig fields as JSON, e.g. \'{"mode": "static"}\'')
    a = sub.add_parser("arenas", help="time filling and pinning host arena memory, on huge pages or not")
    a.add_argument("--gib", type=float, default=16.0)
    a.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    {"write": write, "run": run, "arenas": arenas}[args.command](args)


if __name__ == "__main__":
    main()
