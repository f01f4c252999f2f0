"""GPU check of the chunk runtime: NCCL parity with plain PyTorch, and memory vs the plan.

    torchrun --nproc_per_node 2 -m benchmarks.engine_check [--out results.json]

Part 1 trains tiny GPT-2/Llama through Elixir on every rank and through plain PyTorch (global
batch) on rank 0, and prints the largest loss / weight differences. Part 2 trains GPT-2 small
(124M, seq 1024, bf16, activation checkpointing) under several plans and prints, per GPU, the
memory allocated for model states after ``prepare`` next to the plan's prediction, the peak
during a step, and the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import elixir_runtime as er  # noqa: E402
from helpers.training import Recipe, max_weight_diff, run_elixir, run_reference  # noqa: E402


def parity(rank: int, world: int, device: str) -> list[dict]:
    rows = []
    cases = [
        (Recipe(model="gpt2", ac=False, grad_accum=3, world_size=world, device=device), ("min", 0.5)),
        (Recipe(model="llama", ac=True, world_size=world, device=device), ("max", 1.0)),
        (
            Recipe(
                model="gpt2",
                dtype=torch.bfloat16,
                ac=False,
                clip=None,
                steps=4,
                grad_accum=3,
                world_size=world,
                device=device,
            ),
            ("min", 1.0),
        ),
    ]
    for recipe, (nb, off) in cases:
        got = run_elixir(recipe, rank, n_blocks=nb, offload=off)
        if rank == 0:
            want = run_reference(recipe)
            rows.append(
                {
                    "model": recipe.model,
                    "dtype": str(recipe.dtype),
                    "n_blocks": nb,
                    "offload": off,
                    "max_loss_diff": max(abs(a - b) for a, b in zip(got.losses, want.losses)),
                    "max_weight_diff": max_weight_diff(got.state, want.state),
                    "stats": got.stats,
                }
            )
    return rows


def memory(rank: int, device: torch.device) -> list[dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    rows = []
    cfg = GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024, use_cache=False)
    batch = {"input_ids": torch.randint(0, 50257, (4, 1024), device=device)}
    batch["labels"] = batch["input_ids"]
    for n_blocks, offload in [("max", 0.0), ("min", 0.0), ("min", 0.5), ("min", 1.0)]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        model, opt = er.prepare(
            model,
            opt,
            er.ElixirConfig(mode="static", dtype="bf16", n_blocks=n_blocks, offload=offload),
            example_batch=batch,
        )
        torch.cuda.synchronize()
        states = torch.cuda.memory_allocated(device) - base
        plan = model._elixir.plan
        times = []
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(**batch).loss
            opt.backward(loss)
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "n_blocks": plan.n_blocks,
                "min_blocks": plan.min_blocks,
                "offload": offload,
                "states_gib": states / 2**30,
                "plan_device_gib": plan.device_bytes / 2**30,
                "plan_host_gib": plan.host_bytes / 2**30,
                "peak_step_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "step_s": sum(times[2:]) / len(times[2:]),
                "loss": loss.item(),
            }
        )
        del model, opt
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    result = {"card": torch.cuda.get_device_name(device), "world_size": world, "torch": torch.__version__}
    result["parity"] = parity(rank, world, str(device))
    result["memory"] = memory(rank, device)
    if rank == 0:
        print(json.dumps(result, indent=1))
        for r in result["parity"]:
            print(
                f"parity {r['model']:6s} {r['dtype']:15s} blocks={r['n_blocks']} offload={r['offload']}: "
                f"loss diff {r['max_loss_diff']:.2e}  weight diff {r['max_weight_diff']:.2e}"
            )
        print(f"{'blocks':>6} {'offload':>7} {'states GiB':>10} {'plan GiB':>9} {'peak GiB':>9} {'step s':>7}")
        for r in result["memory"]:
            print(
                f"{r['n_blocks']:>6} {r['offload']:>7} {r['states_gib']:>10.3f} {r['plan_device_gib']:>9.3f} "
                f"{r['peak_step_gib']:>9.3f} {r['step_s']:>7.3f}"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
