"""One system × one model × a list of batch sizes, in its own process (torchrun for several GPUs).

A separate process per system keeps an OOM, a hang or a host OOM-kill from taking the other
systems down, and gives each system a clean GPU and a clean host. Rank 0 prints one
``RESULT {json}`` line per batch size, combined over ranks:

    python -m benchmarks._worker --system plain --model 1.5b --batch-sizes 8,16 [--device cpu]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from elixir_runtime.hardware.cards import CARDS

from .harness import MAX_GRAD_NORM, SYSTEMS, Context, Trainer, Unavailable, on_trainer_path
from .hostmem import GIB, HostMemorySampler, host_total_bytes, rss_bytes
from .models import attention_flops_per_token, param_count, preset, vocab_size
from .systems import build

PG_TIMEOUT_S = 300
_DIST_SYSTEMS = ("fsdp2", "fsdp2_offload", "ds2_offload", "ds3_offload", "ds3_partial")
_CPU_COLLECTIVE_SYSTEMS = ("fsdp2_offload",)
"""Systems whose clip reduces CPU tensors (FSDP2's offloaded DTensor grads): gloo beside NCCL, as torchtitan does."""


def log(msg: str) -> None:
    rank = f"[r{os.environ['RANK']}]" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"[{time.strftime('%H:%M:%S')}]{rank} {msg}", flush=True)


def setup(args: argparse.Namespace) -> Context:
    """Threads, device and (where the system or the world size needs one) the process group."""
    world, rank, local = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
    torch.set_num_threads(args.threads)
    dev = torch.device("cuda", local) if args.device == "cuda" else torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 or args.system in _DIST_SYSTEMS:
        for key, value in (
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29517"),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
        ):
            os.environ.setdefault(key, value)
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        if dev.type == "cuda":
            backend = "cuda:nccl,cpu:gloo" if args.system in _CPU_COLLECTIVE_SYSTEMS else "nccl"
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=dev)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return Context(
        dev,
        world,
        rank,
        seq=args.seq,
        ds_pin=bool(args.ds_pin),
        ds_ratio=args.ds_ratio,
        threads=args.threads,
        clip=bool(args.clip),
        skip_nonfinite=bool(args.skip_nonfinite),
        device_lane=args.device_lane,
        lean_loss=bool(args.lean_loss),
        liger=on_trainer_path(args.system, args.liger),
        compile=on_trainer_path(args.system, args.compile),
    )


def gpu_peaks(dev: torch.device) -> dict[str, float]:
    if dev.type != "cuda":
        return {"gpu_alloc_peak_GiB": 0.0, "gpu_reserved_peak_GiB": 0.0}
    stats = torch.cuda.memory_stats(dev)
    return {
        "gpu_alloc_peak_GiB": torch.cuda.max_memory_allocated(dev) / GIB,
        "gpu_reserved_peak_GiB": torch.cuda.max_memory_reserved(dev) / GIB,
        # the caching allocator freed its cache and retried a cudaMalloc: a device sync each, a
        # step slower than its plan for want of GPU memory headroom
        "gpu_alloc_retries": stats.get("num_alloc_retries", 0),
    }


def env_info(dev: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(card=props.name, gpu_total_GiB=props.total_memory / GIB, cuda=torch.version.cuda)
    else:
        info.update(card="cpu", gpu_total_GiB=0.0)
    info["host_total_GiB"] = host_total_bytes() / GIB
    return info


def time_steps(
    trainer: Trainer, ids: torch.Tensor, warmup: int, steps: int, dev: torch.device, label: str
) -> tuple[list[float], float]:
    """Wall time of each timed step, synchronized at both ends; returns (times, last loss)."""
    if trainer.timed is not None:
        times, loss_value = trainer.timed(ids, warmup, steps)
        log(f"{label} timed steps {', '.join(f'{t:.3f}s' for t in times)} loss {loss_value:.3f}")
        return times, loss_value
    times, loss_value = [], float("nan")
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss = trainer.step(ids)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        loss_value = float(loss.detach())
        log(f"{label} step {i} {'warmup' if i < warmup else 'timed'} {dt:.3f}s loss {loss_value:.3f}")
        if i >= warmup:
            times.append(dt)
    return times, loss_value


def measure(
    trainer: Trainer, ctx: Context, bs: int, args: argparse.Namespace, sampler: HostMemorySampler, vocab: int
) -> dict[str, Any]:
    """One batch size on this rank: step times and peaks, or how it failed."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    sampler.reset()
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(1000 * ctx.rank + bs)
    ids = torch.randint(0, vocab, (bs, args.seq), device=ctx.device, generator=gen)
    out: dict[str, Any] = {"status": "ok"}
    try:
        out["step_times_s"], out["loss"] = time_steps(
            trainer, ids, args.warmup, args.steps, ctx.device, f"{args.system} bs {bs}"
        )
        if not math.isfinite(out["loss"]):  # skipped or garbage steps: their times are no result
            out.update(status="error", error=f"non-finite loss {out['loss']} in the timed steps")
    except torch.OutOfMemoryError as exc:
        out.update(status="OOM", error=str(exc).splitlines()[0][:300])
        trainer.after_oom()
    except Exception as exc:  # noqa: BLE001 - any failure of a system is a result, not a crash of the harness
        traceback.print_exc()
        out.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400])
    sampler.sample()
    out.update(
        gpu_peaks(ctx.device), host_rss_peak_GiB=sampler.peak_rss / GIB, host_used_peak_GiB=sampler.peak_used / GIB
    )
    stats = trainer.info.get("runtime_stats") or {}
    if stats.get("cpu_update_s"):  # this rank's CPU lane over every step so far, warm-up included
        out["cpu_update_Gps"] = stats["updated_cpu"] / stats["cpu_update_s"] / 1e9
    return out


def card_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the card ``torch.cuda.get_device_name`` names (``hardware.cards``); ``None``: unknown."""
    return next((c.bf16_tflops for c in CARDS.values() if c.device == device_name), None)


def combine(parts: list[dict[str, Any]], base: dict[str, Any], params: int) -> dict[str, Any]:
    """Rank 0's record: the slowest rank's step times, GPU peaks of the worst rank, host RSS and the
    caching allocator's retries summed over ranks."""
    rec = dict(base)
    failed = [p for p in parts if p["status"] != "ok"]
    if failed:
        worst = next((p for p in failed if p["status"] == "OOM"), failed[0])
        rec.update(status=worst["status"], error=worst.get("error"))
    else:
        per_step = [max(ts) for ts in zip(*(p["step_times_s"] for p in parts))]
        step_s = statistics.median(per_step)
        tokens = base["batch"] * base["seq"]
        rec.update(
            status="ok",
            step_s=step_s,
            step_times_s=per_step,
            tflops=8 * params * tokens / step_s / 1e12,
            tflops_aggregate=base["gpus"] * 8 * params * tokens / step_s / 1e12,
            tokens_per_s=base["gpus"] * tokens / step_s,
            loss=parts[0]["loss"],
        )
        peak = card_peak_tflops(base.get("card", ""))
        if (
            peak is not None
        ):  # model FLOPs (6 x params, attention counted, no recompute) over the card's dense bf16 peak
            per_token = 6 * params + base["attention_flops_per_token"]
            rec["mfu"] = per_token * tokens / step_s / 1e12 / peak
    for key in ("gpu_alloc_peak_GiB", "gpu_reserved_peak_GiB", "host_used_peak_GiB"):
        rec[key] = max(p[key] for p in parts)
    rec["host_rss_peak_GiB"] = sum(p["host_rss_peak_GiB"] for p in parts)
    rec["gpu_alloc_retries"] = sum(p.get("gpu_alloc_retries", 0) for p in parts)
    rec["host_rss_peak_per_rank_GiB"] = [p["host_rss_peak_GiB"] for p in parts]
    rec["host_rss_start_GiB"] = sum(p["host_rss_start_GiB"] for p in parts)
    if all("cpu_update_Gps" in p for p in parts):
        rec["cpu_update_Gps_per_rank"] = [p["cpu_update_Gps"] for p in parts]
    predicted = (rec.get("info") or {}).get("plan", {}).get("predicted_step_s")
    if predicted is not None and rec.get("step_s"):
        rec.update(predicted_step_s=predicted, measured_over_predicted=rec["step_s"] / predicted)
    return rec


def gather(obj: Any, ctx: Context) -> list[Any]:
    if ctx.world == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def clip_fields(clip: bool) -> dict[str, Any]:
    """What a run records of its clipping: ``"clip": true/false`` and the norm it clipped to."""
    return {"clip": clip, "max_grad_norm": MAX_GRAD_NORM if clip else None}


def emit(rec: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(rec), flush=True)


def run(args: argparse.Namespace) -> None:
    ctx = setup(args)
    sampler = HostMemorySampler().start()
    batch_sizes = sorted(args.batch_sizes)
    model = preset(args.model)
    params, vocab = param_count(model, args.seq), vocab_size(model)
    env = env_info(ctx.device)
    base = {
        "system": args.system,
        "model": args.model,
        "params": params,
        "gpus": ctx.world,
        "seq": args.seq,
        "attention_flops_per_token": attention_flops_per_token(model, args.seq),
        **clip_fields(ctx.clip),
        "liger": ctx.liger,
        "compile": ctx.compile,
        "warmup": args.warmup,
        "steps": args.steps,
        **env,
    }
    log(
        f"{args.system} {args.model} ({params / 1e9:.2f} B params) on {env['card']} x{ctx.world}, batch sizes {batch_sizes}"
    )

    t0 = time.perf_counter()
    example = torch.randint(0, vocab, (batch_sizes[0], args.seq), device=ctx.device)
    rss_start = rss_bytes() / GIB  # the process before any model: torch, CUDA context, libraries
    try:
        trainer: Trainer | None = build(args.system, model, ctx, example)
        build_error: dict[str, Any] = {}
    except Unavailable as exc:
        trainer, build_error = None, {"status": "unavailable", "error": str(exc)}
    except torch.OutOfMemoryError as exc:
        trainer, build_error = None, {"status": "OOM", "error": "build: " + str(exc).splitlines()[0][:300]}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        oom = type(exc).__name__ == "PlanError"  # Elixir refusing a plan that cannot fit
        trainer, build_error = (
            None,
            {"status": "OOM" if oom else "error", "error": f"build: {type(exc).__name__}: {exc}"[:400]},
        )
    base.update(
        build_s=time.perf_counter() - t0,
        host_rss_build_peak_GiB=sampler.peak_rss / GIB,
        info=trainer.info if trainer else {},
    )
    log(f"built in {base['build_s']:.1f}s" if trainer else f"build failed: {build_error['error']}")

    oom_at: int | None = None
    for bs in batch_sizes:
        if trainer is None:
            part = dict(
                build_error,
                **gpu_peaks(ctx.device),
                host_rss_peak_GiB=sampler.peak_rss / GIB,
                host_used_peak_GiB=sampler.peak_used / GIB,
            )
        elif oom_at is not None:  # a larger batch cannot fit where a smaller one did not
            part = dict(
                status="OOM",
                error=f"not run: OOM at batch {oom_at}",
                **gpu_peaks(ctx.device),
                host_rss_peak_GiB=0.0,
                host_used_peak_GiB=0.0,
            )
        else:
            part = measure(trainer, ctx, bs, args, sampler, vocab)
        part["host_rss_start_GiB"] = rss_start
        parts = gather(part, ctx)
        if any(p["status"] == "OOM" for p in parts) and oom_at is None and trainer is not None:
            oom_at = bs
        if ctx.rank == 0:
            emit(combine(parts, dict(base, batch=bs), params))
    sampler.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", required=True, type=lambda s: [int(x) for x in s.split(",")], help="per GPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    ap.add_argument("--ds-pin", type=int, default=1, choices=(0, 1), help="DeepSpeed pin_memory for offloaded states")
    ap.add_argument("--ds-ratio", type=float, default=0.5, help="ds3_partial: offload_optimizer.ratio")
    ap.add_argument("--skip-nonfinite", type=int, default=1, choices=(0, 1), help="ElixirConfig.skip_nonfinite")
    ap.add_argument(
        "--device-lane", default="off", choices=("off", "on", "auto"), help="ElixirConfig.device_assisted_update"
    )
    ap.add_argument(
        "--clip", type=int, default=1, choices=(0, 1), help=f"clip gradients to a global norm of {MAX_GRAD_NORM}"
    )
    ap.add_argument(
        "--lean-loss", type=int, default=1, choices=(0, 1), help="Elixir's model gets the lean causal-LM loss"
    )
    ap.add_argument("--liger", action="store_true", help="use_liger_kernel=True in the Trainer-path systems")
    ap.add_argument("--compile", action="store_true", help="torch_compile=True in the Trainer-path systems")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))
    # Every result is out: skip the interpreter's teardown (engine threads, NCCL, unregistering tens of
    # GiB of pinned memory), which can take minutes or hang, while the parent waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
