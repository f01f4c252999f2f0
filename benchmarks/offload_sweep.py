"""Measured against predicted step time as the offloaded share grows, on one GPU.

    PYTHONPATH=src python -m benchmarks.offload_sweep --model 6.5b --batch 16 --offload auto,0.5,0.7 \\
        --threads 16,15 [--clip 1.0] [--device-lane off,auto] [--out sweep.json]

Builds the model once (bf16, on the host), then for each offload choice prepares a copy with the
auto planner (``auto``: its own choice; a fraction: that many chunks pinned to the host, chunk
size and rCache still searched) and each ``--device-lane`` setting (``ElixirConfig.device_assisted_update``:
off, on, auto) and times steps with the CPU Adam at each thread count. Shows
where the cost model departs from the measured step as more is offloaded, and what the training
loop's Python thread loses when the CPU Adam takes every core.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

import elixir_runtime as er
from elixir_hf.commands.plan import DEVICE_LANE_WORDS
from elixir_runtime.kernels.select import select_kernel

from .models import VOCAB, build_meta, count_params, materialize, preset


def time_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def run(
    pristine: torch.nn.Module, batch: dict, offload: str, lane: str, threads: list[int], a: argparse.Namespace
) -> list[dict]:
    model = copy.deepcopy(pristine)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    config = er.ElixirConfig(
        mode="auto",
        dtype="bf16",
        device="cuda",
        clips_grads=a.clip > 0,
        offload=None if offload == "auto" else float(offload),
        device_assisted_update=DEVICE_LANE_WORDS[lane],
    )
    try:
        model, opt = er.prepare(model, opt, config, example_batch=batch)
    except er.PlanError as err:
        return [{"offload": offload, "device_lane": lane, "status": "no plan", "error": str(err)[:300]}]
    plan = model._elixir.plan

    def step() -> None:
        loss = model(**batch).loss
        opt.backward(loss)
        if a.clip > 0:
            opt.clip_grad_norm(a.clip)
        opt.step()
        opt.zero_grad()

    rows = []
    for t in threads or [opt.cpu_threads]:
        opt.kernels["host"] = select_kernel("cpu", t)
        stats = dict(model._elixir.runtime.stats)
        times = time_steps(step, a.warmup, a.steps)
        updated = {k: model._elixir.runtime.stats[k] - stats[k] for k in ("updated_cpu", "updated_device")}
        measured = sorted(times)[len(times) // 2]
        rows.append(
            {
                "offload": offload,
                "device_lane": lane,
                "lane_numel": plan.device_lane,
                "updated": updated,
                "threads": t,
                "status": "ok",
                "step_s": measured,
                "step_times_s": times,
                "predicted_s": plan.predicted_step_s,
                "measured_over_predicted": measured / plan.predicted_step_s,
                "n_offloaded": len(plan.offload),
                "n_chunks": plan.n_chunks,
                "n_blocks": plan.n_blocks,
                "host_GiB": plan.host_bytes / 2**30,
                "device_GiB": plan.device_bytes / 2**30,
                "gpu_peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
                "predicted": plan.to_dict()["predicted"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    model = opt = None  # freed before the next copy
    gc.collect()  # the engine's hooks form reference cycles
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="6.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--offload", default="auto", help="comma-separated: auto or fractions of the chunks")
    ap.add_argument("--threads", default="", help="comma-separated CPU Adam threads (default: the engine's choice)")
    ap.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm each step (0: no clipping)")
    ap.add_argument(
        "--device-lane", default="auto", help="comma-separated: off, on, auto (ElixirConfig.device_assisted_update)"
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    p = preset(a.model)
    pristine = materialize(build_meta(p, a.seq, torch.bfloat16), "cpu", dev)
    torch.cuda.empty_cache()
    ids = torch.randint(0, VOCAB, (a.batch, a.seq), device=dev)
    batch = {"input_ids": ids, "labels": ids}
    threads = [int(t) for t in a.threads.split(",") if t]
    rows = []
    for lane in a.device_lane.split(","):
        for offload in a.offload.split(","):
            rows += run(pristine, batch, offload.strip(), lane.strip(), threads, a)
    params = count_params(pristine)
    result = {"card": torch.cuda.get_device_name(), "model": a.model, "batch": a.batch, "clip": a.clip, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"{'offload':>8} {'lane':>5} {'threads':>7} {'chunks off':>10} {'host GiB':>8} {'step s':>7} {'pred s':>7} {'meas/pred':>9} {'TFLOPS':>7}"
    )
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['offload']:>8} {r['device_lane']:>5} {r['status']}: {r['error']}")
            continue
        tflops = 8 * params * a.batch * a.seq / r["step_s"] / 1e12
        print(
            f"{r['offload']:>8} {r['device_lane']:>5} {r['threads']:>7} {r['n_offloaded']:>4}/{r['n_chunks']:<5} {r['host_GiB']:>8.1f} "
            f"{r['step_s']:>7.3f} {r['predicted_s']:>7.3f} {r['measured_over_predicted']:>9.2f} {tflops:>7.1f}"
        )


if __name__ == "__main__":
    main()
