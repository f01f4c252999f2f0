"""Adam update rate with exact (fp32) against 8-bit moments: the Triton kernel on the GPU, the C++
kernel on the host, one arena of ``--numel`` elements (default 2^28) split into uneven segments of
two groups (decay / no decay), each starting a quantization block as the layout places them.

Bytes an update moves per element (bf16 grad read, bf16 param written): fp32 state 28, 8-bit state
about 16 (the master read and written, a code per moment read and written, a scale per 256). The
GPU rows sweep (block, num_warps) per mode and report the best; the CPU rows run both modes with
``--threads``. Prints a table and, with ``--json``, one JSON object on the last line.
``PYTHONPATH=src python -m benchmarks.adam8_rate [--json] [--numel N] [--cpu-numel N] [--threads T]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from elixir_runtime.adam_state import ADAM_STATE, QUANT_BLOCK, AdamTensors
from elixir_runtime.chunk.layout import GroupRange, round_up
from elixir_runtime.kernels.kernel import AdamHyper

from .gpu_adam import median_ms

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
HYPERS = [AdamHyper(LR, *BETAS, EPS, WD, True), AdamHyper(LR, *BETAS, EPS, 0.0, True)]
GRAD, OUT = torch.bfloat16, torch.bfloat16
CONFIGS = {  # (block, num_warps) per mode
    "fp32": ((1024, 4), (2048, 8), (4096, 8)),
    "8bit": ((512, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)),
}


def traffic(moments: str) -> float:
    """Bytes per element one update moves: the state read and written, the grad and param copy."""
    return 2 * ADAM_STATE[moments].bytes_per_element() + GRAD.itemsize + OUT.itemsize


def segments(n: int) -> tuple[GroupRange, ...]:
    """Uneven segments alternating the two groups, each starting a quantization block."""
    cuts = sorted(
        {
            0,
            n,
            *(
                min(n, round_up(int(n * f) + 13 * i, QUANT_BLOCK))
                for i, f in enumerate((0.01, 0.1, 0.3, 0.31, 0.6, 0.9), 1)
            ),
        }
    )
    return tuple(GroupRange(a, b - a, i % 2) for i, (a, b) in enumerate(zip(cuts, cuts[1:])))


def arena(moments: str, n: int, device: str) -> tuple[AdamTensors, torch.Tensor, torch.Tensor]:
    """A state after zero steps (random master, zero moments), a random grad and the param copy."""
    spec = ADAM_STATE[moments]
    tensors = {t.kind: torch.zeros(t.entries(n), dtype=t.dtype, device=device) for t in spec.tensors}
    tensors["master"].normal_()
    grad = torch.randn(n, device=device).to(GRAD)
    return AdamTensors(spec, tensors), grad, torch.empty(n, dtype=OUT, device=device)


def stepper(kernel: object, state: AdamTensors, grad: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    segs, count = segments(state.numel), [0]

    def run() -> None:
        count[0] += 1
        kernel.step(state, grad, out, segs, HYPERS, count[0], 1.0)  # type: ignore[attr-defined]

    return run


def cpu_ms(fn: Callable[[], None], iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(n: int, iters: int) -> float:
    """A device-to-device copy moving 28 bytes per element: the bandwidth ceiling."""
    src = torch.empty(n * 14, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src), iters) / 1e6


def run_gpu(n: int, iters: int) -> dict[str, object]:
    from elixir_runtime.kernels.triton_adam import TritonAdamKernel

    dev = torch.device("cuda")
    out: dict[str, object] = {"card": torch.cuda.get_device_name(dev), "copy_gbps": copy_gbps(n, iters)}
    for moments, configs in CONFIGS.items():
        state, grad, param = arena(moments, n, "cuda")
        times = {}
        for block, warps in configs:
            kw = dict(block8=block, num_warps8=warps) if moments == "8bit" else dict(block=block, num_warps=warps)
            times[f"{block}x{warps}"] = median_ms(stepper(TritonAdamKernel(**kw), state, grad, param), iters)
        best = min(times, key=times.__getitem__)
        out[moments] = {
            "ms": times[best],
            "best_config": best,
            "elements_per_s": n / times[best] * 1e3,
            "gbps": traffic(moments) * n / times[best] / 1e6,
            "configs_ms": times,
        }
        del state, grad, param
        torch.cuda.empty_cache()
    return out


def run_cpu(n: int, iters: int, threads: int) -> dict[str, object]:
    from elixir_runtime.kernels.cpu_adam import CpuAdamKernel

    kernel = CpuAdamKernel(threads=threads)
    out: dict[str, object] = {"isa": kernel.isa, "threads": threads}
    for moments in ADAM_STATE:
        try:
            ms = cpu_ms(stepper(kernel, *arena(moments, n, "cpu")), iters)
        except Exception as err:  # noqa: BLE001 - report the mode the kernel lacks, time the other
            out[moments] = {"error": repr(err)}
            continue
        out[moments] = {"ms": ms, "elements_per_s": n / ms * 1e3, "gbps": traffic(moments) * n / ms / 1e6}
    return out


def _row(where: str, moments: str, r: object, numel: int) -> str:
    if not isinstance(r, dict) or "ms" not in r:
        return (
            f"{where:5} {moments:5} {'-':>10} {'-':>12} {'-':>9}  {r.get('error', '') if isinstance(r, dict) else ''}"
        )
    cfg = f"  best {r['best_config']}" if "best_config" in r else ""
    return f"{where:5} {moments:5} {r['ms']:10.2f} {r['elements_per_s'] / 1e9:12.2f} {r['gbps']:9.1f}  {numel}{cfg}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--numel", type=int, default=1 << 28, help="GPU arena elements (default 2^28)")
    ap.add_argument("--cpu-numel", type=int, default=None, help="host arena elements (default: --numel)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=20, help="GPU timing iterations")
    ap.add_argument("--cpu-iters", type=int, default=5)
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--no-cpu", action="store_true")
    args = ap.parse_args(argv)
    cpu_n = args.cpu_numel or args.numel
    result: dict[str, object] = {
        "numel": args.numel,
        "cpu_numel": cpu_n,
        "bytes_per_element": {m: traffic(m) for m in ADAM_STATE},
        "torch": torch.__version__,
    }
    if not args.no_gpu and torch.cuda.is_available():
        result["gpu"] = run_gpu(args.numel, args.iters)
    if not args.no_cpu:
        result["cpu"] = run_cpu(cpu_n, args.cpu_iters, args.threads)

    print(f"{'where':5} {'state':5} {'ms':>10} {'G elem/s':>12} {'GB/s':>9}  elements")
    for where, n in (("gpu", args.numel), ("cpu", cpu_n)):
        part = result.get(where)
        if isinstance(part, dict):
            for moments in ADAM_STATE:
                print(_row(where, moments, part.get(moments), n))
            fp, q = part.get("fp32"), part.get("8bit")
            if isinstance(fp, dict) and isinstance(q, dict) and "ms" in fp and "ms" in q:
                part["speedup_8bit"] = fp["ms"] / q["ms"]
                print(f"{where}: 8bit {part['speedup_8bit']:.2f}x fp32's rate")
    gpu = result.get("gpu")
    if isinstance(gpu, dict):
        print(f"gpu: {gpu['card']}, copy {gpu['copy_gbps']:.0f} GB/s")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
