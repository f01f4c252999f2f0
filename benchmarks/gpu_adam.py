"""Bandwidth of the Triton fused Adam against a device-to-device copy and torch's fused AdamW.

Ours moves 28 bytes/param (read fp32 p/m/v + bf16 grad, write fp32 p/m/v + bf16 param); the
target is >= 85 % of a plain copy's bandwidth and faster than ``torch.optim.AdamW(fused=True)``
(fp32 grads, as it requires; shown with and without its separate bf16 copy-out). Sweeps a few
(block, num_warps) configurations and reports the best.
``PYTHONPATH=src python -m benchmarks.gpu_adam [--json] [--numel N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from elixir_runtime.adam_state import ADAM_STATE, AdamTensors
from elixir_runtime.chunk.layout import GroupRange
from elixir_runtime.kernels.kernel import AdamHyper
from elixir_runtime.kernels.triton_adam import TritonAdamKernel

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28
CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16))


def median_ms(fn: Callable[[], None], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _segments(n: int) -> tuple[GroupRange, ...]:
    """Uneven segments alternating two groups (decay / no decay), like a real arena."""
    cuts = sorted({0, n, *(min(n, int(n * f) + 13 * i) for i, f in enumerate((0.01, 0.1, 0.3, 0.31, 0.6, 0.9), 1))})
    return tuple(GroupRange(a, b - a, i % 2) for i, (a, b) in enumerate(zip(cuts, cuts[1:])))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--numel", type=int, default=1 << 28, help="parameters per step (default 2^28)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    n, dev = args.numel, torch.device("cuda")

    # A device-to-device copy of the same bytes: the bandwidth ceiling.
    src = torch.empty(n * BYTES_PER_PARAM // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), args.iters)
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    src = dst = None

    p, m, v = torch.randn(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    state = AdamTensors(ADAM_STATE["fp32"], {"master": p, "exp_avg": m, "exp_avg_sq": v})
    g = torch.randn(n, device=dev).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    segs = _segments(n)
    hypers = [AdamHyper(LR, *BETAS, EPS, WD, True), AdamHyper(LR, *BETAS, EPS, 0.0, True)]
    ours_ms = {}
    for block, warps in CONFIGS:
        kernel = TritonAdamKernel(block=block, num_warps=warps)
        ours_ms[(block, warps)] = median_ms(
            lambda kernel=kernel: kernel.step(state, g, out, segs, hypers, 1, 1.0), args.iters
        )
    best = min(ours_ms, key=ours_ms.get)
    p = m = v = g = state = None

    param = torch.nn.Parameter(torch.randn(n, device=dev))
    param.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    fused_ms = median_ms(opt.step, args.iters)
    fused_copy_ms = median_ms(lambda: (opt.step(), out.copy_(param.detach())), args.iters)

    gbps = lambda ms: BYTES_PER_PARAM * n / ms / 1e6  # noqa: E731
    result = {
        "card": torch.cuda.get_device_name(dev),
        "numel": n,
        "copy_gbps": copy_gbps,
        "ours_best_config": {"block": best[0], "num_warps": best[1]},
        "ours_ms": ours_ms[best],
        "ours_gbps": gbps(ours_ms[best]),
        "ours_frac_of_copy": gbps(ours_ms[best]) / copy_gbps,
        "ours_params_per_s": n / ours_ms[best] * 1e3,
        "torch_fused_ms": fused_ms,
        "torch_fused_copy_ms": fused_copy_ms,
        "torch_fused_params_per_s": n / fused_ms * 1e3,
        "speedup_vs_torch_fused": fused_ms / ours_ms[best],
        "speedup_vs_torch_fused_with_copy": fused_copy_ms / ours_ms[best],
        "configs_ms": {f"{b}x{w}": t for (b, w), t in ours_ms.items()},
        "torch": torch.__version__,
    }
    print(f"{result['card']}, numel {n}, torch {torch.__version__}")
    print(f"{'what':36} {'ms':>8} {'GB/s @28B/param':>16} {'% of copy':>10}")
    print(f"{'device-to-device copy':36} {copy_ms:8.3f} {copy_gbps:16.1f} {100.0:9.1f}%")
    for (b, w), t in ours_ms.items():
        print(f"{f'triton adam block={b} warps={w}':36} {t:8.3f} {gbps(t):16.1f} {100 * gbps(t) / copy_gbps:9.1f}%")
    for name, t in (("torch AdamW(fused=True)", fused_ms), ("torch fused + bf16 copy", fused_copy_ms)):
        print(f"{name:36} {t:8.3f} {gbps(t):16.1f} {100 * gbps(t) / copy_gbps:9.1f}%")
    print(
        f"best: {result['ours_frac_of_copy']:.1%} of copy, {result['speedup_vs_torch_fused']:.2f}x torch fused "
        f"({result['speedup_vs_torch_fused_with_copy']:.2f}x with its bf16 copy)"
    )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
