"""Where a model's forward and backward go on this GPU, by kind of kernel, beside the cost model's split.

    PYTHONPATH=src:. python -m benchmarks.compute_split --model llama3-8b --batch-size 8 [--seq 2048]
        [--liger] [--hardware hw.json] [--json]

One step of a preset (``benchmarks.models``: bf16, SDPA, activation checkpointing on every block,
GPT-2's init, each gradient dropped once accumulated, as the engine does) runs under
``torch.profiler``. Each CUDA kernel's time is summed by class: GEMMs, fused attention, and the
rest (norms, activations, casts, the loss, copies: memory-bound). Beside each, the seconds the
hardware profile prices for the same class (``search.step_time.roofline_parts``: GEMM FLOPs at
their size class's rate, attention at its length's, the other ops' bytes at the memory-bound
ops' rate, ``elementwise``) on the step's fake-tensor profile, traced with the masks the run uses
(``elixir_hf.patches.mask_decisions_of``). ``memory_bound_at`` is the share of that rate the rest
reached. docs/planning.md, "The compute split", has its tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from elixir_hf.patches import mask_decisions_of
from elixir_runtime.hardware import load_hardware
from elixir_runtime.hardware.load import own_profile, with_step_gemms
from elixir_runtime.profiler import profile_model
from elixir_runtime.search.step_time import roofline_parts

from .models import build_meta, materialize, preset, vocab_size
from .profiler_accuracy import drop_grads_when_accumulated, step

CLASSES = ("gemm", "attention", "memory")
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn", "compute_dot_do_o", "convert_dq")
"""Fused attention kernels (FlashAttention, memory-efficient, cuDNN's fused SDPA and its helpers)."""
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")
"""cuBLAS/cuBLASLt GEMMs (``nvjet_*`` on Hopper, ``sm90_xmma_gemm_*``, CUTLASS) and their split-k reductions."""


def kernel_class(name: str) -> str:
    """``gemm``, ``attention`` or ``memory`` for a CUDA kernel's name (attention first: cuDNN's fused
    attention kernels carry ``sm90`` and ``wgmma`` as GEMMs do)."""
    low = name.lower()
    if any(s in low for s in _ATTENTION):
        return "attention"
    if any(s in low for s in _GEMM):
        return "gemm"
    return "memory"


def measured_split(events: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds by class of ``(kernel name, microseconds)`` pairs."""
    split = dict.fromkeys(CLASSES, 0.0)
    for name, us in events:
        split[kernel_class(name)] += us / 1e6
    return split


def _kernels(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[list[tuple[str, float]], float]:
    """The CUDA kernels one step ran (name, microseconds) and the step's wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    step(model, batch)  # warm-up: cuBLAS heuristics, Triton compiles, the allocator's pools
    torch.cuda.synchronize()
    start = time.perf_counter()
    step(model, batch)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, batch)
        torch.cuda.synchronize()
    kernels = [
        (e.key, e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    return kernels, wall


def build(name: str, seq: int, liger: bool) -> torch.nn.Module:
    """The preset on the GPU in bf16 with GPT-2's init, each gradient dropped once accumulated."""
    model = build_meta(preset(name), seq, torch.bfloat16)
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    materialize(model, "cuda", "cuda")
    drop_grads_when_accumulated(model)
    return model.train()


def run(args: argparse.Namespace) -> dict[str, Any]:
    hardware = load_hardware(args.hardware)
    model = build(args.model, args.seq, args.liger)
    ids = torch.randint(0, vocab_size(preset(args.model)), (args.batch_size, args.seq), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    with mask_decisions_of(batch):
        profile = profile_model(model, batch, dtype=torch.bfloat16, device="cuda")
    if args.hardware is None and own_profile():  # as a job here prices them: its step's GEMM shapes, timed
        hardware = with_step_gemms(hardware, profile.flop_classes, torch.bfloat16, torch.device("cuda"))
    rates = hardware.rates(1)
    ops = sum(c.ops for c in profile.compute.values())
    predicted = dict.fromkeys(CLASSES, 0.0)
    for cost in profile.compute.values():
        for cls, seconds in roofline_parts(cost, rates).items():
            predicted[cls] += seconds
    kernels, wall = _kernels(model, batch)
    measured = measured_split(kernels)
    return {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "hardware": hardware.source,
        "model": args.model,
        "batch": args.batch_size,
        "seq": args.seq,
        "liger": args.liger,
        "step_s": wall,
        "measured_s": measured,
        "predicted_s": predicted,
        "ops": ops,
        "op_overhead_s": ops * rates.op_overhead,
        "memory_bound_at": predicted["memory"] / measured["memory"] if measured["memory"] else None,
        "kernels": sorted(kernels, key=lambda k: -k[1])[:40],
    }


def render(row: dict[str, Any]) -> str:
    lines = [
        f"{row['card']}: {row['model']} batch {row['batch']} x {row['seq']}{' (Liger)' if row['liger'] else ''},"
        f" one step {row['step_s']:.3f} s; profile: {row['hardware']}",
        f"{'class':<10} {'measured s':>10} {'predicted s':>11} {'measured / predicted':>20}",
    ]
    for cls in CLASSES:
        m, p = row["measured_s"][cls], row["predicted_s"][cls]
        lines.append(f"{cls:<10} {m:>10.3f} {p:>11.3f} {m / p if p else float('nan'):>20.2f}")
    total_m, total_p = sum(row["measured_s"].values()), sum(row["predicted_s"].values())
    lines.append(f"{'kernels':<10} {total_m:>10.3f} {total_p:>11.3f} {total_m / total_p:>20.2f}")
    if row["memory_bound_at"] is not None:
        lines.append(f"memory-bound kernels at {row['memory_bound_at']:.0%} of the rate the profile prices them at")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a preset of benchmarks.models (llama3-8b, gpt2-4b, ...)")
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--liger", action="store_true", help="Liger's kernels on the model (liger-kernel installed)")
    ap.add_argument("--hardware", default=None, help="a profile file or shipped name (default: this machine's)")
    ap.add_argument("--json", action="store_true", help="print the row as JSON instead of a table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("compute_split needs a CUDA GPU: it times the step's kernels", file=sys.stderr)
        return 2
    row = run(args)
    print(json.dumps(row, indent=1) if args.json else render(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
