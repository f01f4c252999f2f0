"""Params/s of our C++ CPU Adam against torch's CPU AdamW on the same data and threads.

Ours reads a bf16 grad and writes the bf16 param copy in its one pass; torch needs an fp32 grad
and a separate copy to bf16, so that copy (into a preallocated buffer) is added to torch's time.
The "8-bit moments" row is ours on the ``"8bit"`` state (``adam_state.py``): same arena, same grads.
``python -m benchmarks.cpu_adam [--json] [--numel N] [--threads T] [--deepspeed]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from elixir_runtime.adam_state import ADAM_STATE, AdamTensors
from elixir_runtime.chunk.host_memory import empty_arena
from elixir_runtime.chunk.layout import GroupRange
from elixir_runtime.kernels.cpu_adam import CpuAdamKernel
from elixir_runtime.kernels.kernel import AdamHyper

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _ours(
    n: int, grad_dtype: torch.dtype, threads: int, huge_pages: bool = False, moments: str = "fp32"
) -> Callable[[], None]:
    """``huge_pages``: the arenas allocated as the engine's host arenas are (``empty_arena``)."""
    kernel = CpuAdamKernel(threads=threads)
    alloc = empty_arena if huge_pages else lambda numel, dtype: torch.empty(numel, dtype=dtype)
    spec = ADAM_STATE[moments]
    state = AdamTensors(spec, {t.kind: alloc(t.entries(n), t.dtype) for t in spec.tensors})
    for t, x in state.items():
        x.fill_(t.zero)
    state.master.copy_(torch.randn(n))
    g, out = alloc(n, grad_dtype), alloc(n, torch.bfloat16)
    g.copy_(torch.randn(n))
    out.zero_()
    half = n // 2 // 256 * 256  # two groups, as with decay / no-decay params; a block boundary
    segs = (GroupRange(0, half, 0), GroupRange(half, n - half, 1))
    hypers = [AdamHyper(LR, *BETAS, EPS, WD, True), AdamHyper(LR, *BETAS, EPS, 0.0, True)]
    steps = {"step": 0}

    def run() -> None:
        steps["step"] += 1
        kernel.step(state, g, out, segs, hypers, steps["step"], 1.0)

    return run


def _with_copy(opt: torch.optim.Optimizer, param: torch.Tensor, copy_out: bool) -> Callable[[], None]:
    out = torch.empty(param.numel(), dtype=torch.bfloat16)

    def run() -> None:
        opt.step()
        if copy_out:
            out.copy_(param.detach())

    return run


def _torch(n: int, copy_out: bool, **kind: bool) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
    return _with_copy(opt, param, copy_out)


def _deepspeed(n: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional: only where it is installed

    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    return _with_copy(opt, param, True)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _time_rounds(runs: dict[str, Callable[[], None]], iters: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per run, timed in interleaved rounds so drifting machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(warmup + iters):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--numel", type=int, default=1 << 25, help="parameters per step (default 2^25)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeedCPUAdam (+ bf16 copy)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.numel

    runs = {
        "ours (bf16 grad -> bf16 out)": _ours(n, torch.bfloat16, args.threads),
        "ours (fp32 grad -> bf16 out)": _ours(n, torch.float32, args.threads),
        "ours (bf16 grad, huge pages)": _ours(n, torch.bfloat16, args.threads, huge_pages=True),
        "ours 8-bit moments (bf16 -> bf16)": _ours(n, torch.bfloat16, args.threads, moments="8bit"),
        "torch foreach + bf16 copy": _torch(n, True, foreach=True),
    }
    best_torch = "torch foreach + bf16 copy"
    try:
        fused = _torch(n, True, fused=True)
        fused()  # raises on a build without the fused CPU kernel
        runs["torch fused + bf16 copy"] = fused
        runs["torch fused (no copy)"] = _torch(n, False, fused=True)
        best_torch = "torch fused + bf16 copy"
    except RuntimeError as err:
        print(f"torch fused CPU AdamW unavailable: {err}")
    if args.deepspeed:
        try:
            runs["deepspeed CPUAdam + bf16 copy"] = _deepspeed(n)
        except Exception as err:  # noqa: BLE001 - report, don't fail the comparison
            print(f"deepspeed unavailable: {err!r}")
    secs = _time_rounds(runs, args.iters)

    rate = {name: n / s for name, s in secs.items()}
    ours = rate["ours (bf16 grad -> bf16 out)"]
    result = {
        "ours_params_per_s": ours,
        "torch_params_per_s": rate[best_torch],
        "torch_kind": best_torch,
        "speedup": ours / rate[best_torch],
        "huge_pages_speedup": rate["ours (bf16 grad, huge pages)"] / ours,
        "ours_8bit_params_per_s": rate["ours 8-bit moments (bf16 -> bf16)"],
        "threads": args.threads,
        "numel": n,
        "isa": CpuAdamKernel(threads=args.threads).isa,
        "cpu": _cpu_name(),
        "rates": rate,
    }
    print(f"{'kernel':34} {'ms/step':>9} {'G params/s':>11} {'vs ' + best_torch:>28}")
    for name, s in secs.items():
        print(f"{name:34} {s * 1e3:9.2f} {rate[name] / 1e9:11.3f} {rate[name] / rate[best_torch]:27.2f}x")
    print(f"numel {n}, threads {args.threads}, isa {result['isa']}, cpu {result['cpu']}, torch {torch.__version__}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
