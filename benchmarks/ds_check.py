"""Is DeepSpeed usable here? Import it, JIT-build its CPU Adam and check one step against torch's AdamW.

    python -m benchmarks.ds_check          # on the GPU machine: bash .whl/ds/check.sh (benchmarks/make_wheels.sh)

ZeRO-Offload's optimizer step is DeepSpeed's CPU Adam, a C++ op compiled on first use (ninja, a C++
compiler, torch's headers; about 40 s): a machine that cannot build it cannot run ``ds2_offload`` /
``ds3_offload``, and the throughput harness then records those systems as failed with this error.
Exits 1, with the error, when any step fails.
"""

from __future__ import annotations

import sys
import time

import torch

ELEMENTS = 1 << 20
TOLERANCE = 1e-5
"""Max abs difference of one AdamW step from torch's (fp32, lr 1e-3: the update itself is ~1e-3)."""


def check() -> float:
    """One DeepSpeedCPUAdam (AdamW mode) step against ``torch.optim.AdamW``; returns the max abs difference."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    print(
        f"deepspeed {deepspeed.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"accelerator {get_accelerator()._name}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(ELEMENTS, generator=gen))
    ours.grad = torch.randn(ELEMENTS, generator=gen)
    ref = torch.nn.Parameter(ours.detach().clone())
    ref.grad = ours.grad.clone()
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    t0 = time.perf_counter()
    opt = DeepSpeedCPUAdam([ours], adamw_mode=True, **hyper)
    print(f"CPU Adam op built/loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    opt.step()
    torch.optim.AdamW([ref], **hyper).step()
    return (ours.detach() - ref.detach()).abs().max().item()


def main() -> None:
    try:
        diff = check()
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        print(f"FAILED: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    ok = diff <= TOLERANCE
    print(
        f"{'OK' if ok else 'FAILED'}: one step of DeepSpeedCPUAdam vs torch AdamW, max abs diff {diff:.2e} "
        f"(tolerance {TOLERANCE:.0e})",
        flush=True,
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
