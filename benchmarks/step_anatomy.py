"""Where an Elixir step's time goes: the forward, the backward, and the updates of offloaded chunks.

    python -m benchmarks.step_anatomy --model llama2-13b [--system elixir_trainer [--liger]] [--batch-size 4]
        [--steps 3] [--clip 1] [--json out.json]

Builds the harness's Elixir engine (``systems.build``, the plan its own), runs ``--warmup`` and
``--steps`` steps of the harness's loop (with ``--system elixir_trainer``: ``ElixirTrainer.train()``,
``benchmarks.hf_systems``, stamped by its callbacks and a forward hook), and reports per timed
step, in seconds:

* ``loop``: from the end of the step before to this one's start (the Trainer's logging and its
  next batch; nothing in the harness's loop);

* ``forward``: until the loop's thread has the loss (it runs ahead of the GPU but waits for each
  offloaded chunk's update before gathering it); ``waits``: the part of it spent in those waits;
* ``backward``: from there to the clip's host sync, the end of backward on the GPU (without
  ``--clip`` the loop's own return: the GPU may still be in backward);
* ``GPU fwd``: the GPU's own forward (CUDA events, ``GpuMarks``; each wait's host times and the
  GPU's position then in the JSON's ``waits``, the CPU's slices in ``slices``), and ``stalls``: the
  part of the forward the GPU stood idle for those updates and their uploads (the engine's
  ``update_stall_s``, ``runtime/stalls.py``; on the CPU the waits); ``gathers``: the GPU's idle at
  the step's other acquires, forward and backward, for gathers not hidden (``gather_stall_s``);
* the CPU lane's busy time and rate (elements per busy second) for the update the step waits for,
  the one the step before submitted, from the engine's update trace (``HostUpdates.trace``); the
  device lane's elements if it is on.

Then (the harness only) the same CPU update alone on the same arenas, the GPU idle (``alone``), and the plan's
prediction and hardware rates beside them. Prints a table and one JSON line (``--json``: to a file
too). Runs on the CPU as well (tests; ``--offload`` pins the offloaded fraction there).

``--fused-head`` gives the model TRL's fused LM head (``models.use_fused_head``: the head's weight,
read outside its module, is ``prepare``'s ``resident``: a chunk the root gathers before any unit
runs); ``--update-order chunk`` then updates the offloaded chunks in chunk order, where that chunk
comes last, instead of the engine's order (``ChunkRuntime.update_order``: the root's first): the
A/B of that order. Each step reports the chunk its CPU update started with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from . import harness, systems
from ._worker import env_info
from .gpu_marks import GpuMarks
from .models import param_count, preset, vocab_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lane(trace: list, lane: str, start: float, end: float) -> tuple[float, int]:
    """Busy seconds and elements of ``lane``'s slices that started in ``[start, end)``."""
    rows = [r for r in trace if r[0] == lane and start <= r[2] < end]
    return sum(r[3] - r[2] for r in rows), sum(r[4] for r in rows)


def step_record(trace: list, t: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    """One step's phases from its time stamps ``t`` (start, loss, synced, stepped, end), the previous
    step's ``before`` and the trace: the update submitted after ``before``'s sync ran until ``t``'s
    (its slices in ``slices``: chunk, start and end in seconds since ``t``'s start)."""
    waits = sum(r[3] - r[2] for r in trace if r[0] == "wait" and t["start"] <= r[2] < t["loss"])
    busy, elements = _lane(trace, "cpu", before["synced"], t["synced"])
    first = min(
        (r for r in trace if r[0] == "cpu" and before["synced"] <= r[2] < t["synced"]), key=lambda r: r[2], default=None
    )
    _, device_elements = _lane(trace, "device", before["synced"], t["synced"])
    return {
        "step_s": t["end"] - t["start"],
        "forward_s": t["loss"] - t["start"],
        "waits_s": waits,
        "backward_s": t["synced"] - t["loss"],
        "optimizer_s": t["stepped"] - t["synced"],
        "cpu_busy_s": busy,
        "cpu_elements": elements,
        "cpu_Gps": elements / busy / 1e9 if busy else None,
        "first_updated": None if first is None else first[1],
        "loss": t.get("loss_value"),
        "device_lane_elements": device_elements,
        "slices": [
            (r[1], r[2] - t["start"], r[3] - t["start"])
            for r in trace
            if r[0] == "cpu" and before["synced"] <= r[2] < t["synced"]
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    p = preset(args.model)
    seq = args.seq or p.default_seq
    ctx = harness.Context(
        device,
        1,
        0,
        seq=seq,
        threads=args.threads,
        clip=bool(args.clip),
        offload=args.offload,
        device_lane=args.device_lane,
        fused_head=args.fused_head,
        liger=args.liger,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab_size(p), (args.batch_size, seq), device=device, generator=gen)
    start = time.perf_counter()
    if args.system == "elixir":
        trainer = systems.build("elixir", p, ctx, ids)
        build_s = time.perf_counter() - start
        runtime = trainer.handles["optimizer"].runtime
        if args.update_order == "chunk":
            runtime.update_order = list(runtime.trainable)
        order = {"root_chunks": list(runtime.root_chunks), "update_order": args.update_order}
        stamps, trace, marks, (busy, elements) = _harness_steps(trainer, ctx, ids, args.warmup + args.steps)
    else:
        from .hf_systems import hf_trainer  # transformers' Trainer: imported only where it runs

        trainer = hf_trainer(p, ctx, elixir=True, anatomy=True)
        build_s = time.perf_counter() - start
        trainer.timed(ids, args.warmup, args.steps)
        anatomy = trainer.info.pop("anatomy")
        stamps, trace, marks = anatomy["stamps"], anatomy["trace"], anatomy["marks"]
        busy, elements = 0.0, 0  # no update alone: the Trainer's engine is gone with its loop
        order = {}
    steps = [
        dict(
            step_record(trace, t, before),
            loop_s=t["start"] - before["end"],
            gpu_stalls_s=t["stalls"] - before["stalls"],
            gather_stalls_s=t["gather_stalls"] - before["gather_stalls"],
            **marks.forward(t),
        )
        for before, t in zip(stamps[args.warmup - 1 :], stamps[args.warmup :])
    ]
    median = statistics.median(s["step_s"] + s["loop_s"] for s in steps)
    in_step = [s["cpu_Gps"] for s in steps if s["cpu_Gps"]]
    return {
        "system": args.system,
        "model": args.model,
        "params": param_count(p, seq),
        "batch": args.batch_size,
        "seq": seq,
        "clip": bool(args.clip),
        **env_info(device),
        "build_s": build_s,
        "plan": trainer.info["plan"],
        **order,
        "steps": steps,
        "median_step_s": median,
        "tflops": 8 * param_count(p, seq) * args.batch_size * seq / median / 1e12,
        "cpu_Gps_in_step": statistics.median(in_step) if in_step else None,
        "cpu_Gps_alone": elements / busy / 1e9 if busy else None,
        "alone_elements": elements,
    }


def _harness_steps(trainer: harness.Trainer, ctx: harness.Context, ids: torch.Tensor, n: int) -> tuple:
    """``n`` steps of the harness's loop, stamped; then the same update alone (a backward, then the
    update with the GPU idle and nothing beside it): (stamps, trace, GPU marks, (busy s, elements) alone)."""
    model, opt = trainer.handles["model"], trainer.handles["optimizer"]
    updates = opt.runtime.host_updates
    updates.trace = trace = []
    marks = GpuMarks(updates, ctx.device)

    def step() -> dict[str, float]:
        _sync(ctx.device)
        t = {"start": time.perf_counter()}
        marks.mark("start")
        loss = model(input_ids=ids, labels=ids).loss
        marks.mark("loss")
        t["loss"] = time.perf_counter()
        opt.backward(loss)
        if ctx.clip:
            opt.clip_grad_norm(harness.MAX_GRAD_NORM)  # the host sync: backward is over
        t["synced"] = time.perf_counter()
        opt.step()
        t["stepped"] = time.perf_counter()
        opt.zero_grad()
        _sync(ctx.device)
        t["end"] = time.perf_counter()
        stats = opt.runtime.stats
        t["stalls"], t["gather_stalls"] = stats["update_stall_s"], stats["gather_stall_s"]
        t["loss_value"] = float(loss.detach())  # after the stamps: its host sync is not timed
        return t

    stamps = [step() for _ in range(n)]
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss)
    if ctx.clip:
        opt.clip_grad_norm(harness.MAX_GRAD_NORM)
    updates.wait_all()
    _sync(ctx.device)
    start = time.perf_counter()
    opt.step()
    updates.wait_all()
    end = time.perf_counter()
    alone = _lane(trace, "cpu", start, end)
    opt.zero_grad()
    updates.trace = None
    marks.close()
    return stamps, trace, marks, alone


def table(rec: dict[str, Any]) -> str:
    def num(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    plan, rates = rec["plan"], rec["plan"].get("rates") or {}
    clip = "on" if rec["clip"] else "off"
    offloaded = f"{len(plan.get('offload', []))} of {plan.get('n_chunks')} chunks offloaded"
    lines = [
        f"{rec['system']}: {rec['model']} on {rec['card']}, batch {rec['batch']} x {rec['seq']}, clip {clip}: {offloaded}, "
        f"built in {rec['build_s']:.1f} s"
        + (
            f"; the root's chunks {rec['root_chunks']}, updated {rec['update_order']}" if rec.get("root_chunks") else ""
        ),
        f"{'step':>4} {'loop':>6} {'step s':>7} {'forward':>8} {'waits':>6} {'backward':>9} {'optimizer':>9} "
        f"{'CPU busy':>9} {'CPU G/s':>8} {'first':>6} {'GPU fwd':>8} {'stalls':>7} {'gathers':>8}",
    ]
    for i, s in enumerate(rec["steps"]):
        lines.append(
            f"{i:>4} {s['loop_s']:>6.3f} {s['step_s']:>7.3f} {s['forward_s']:>8.3f} {s['waits_s']:>6.3f} "
            f"{s['backward_s']:>9.3f} {s['optimizer_s']:>9.3f} {s['cpu_busy_s']:>9.3f} {num(s['cpu_Gps'], 2):>8} "
            f"{'-' if s['first_updated'] is None else s['first_updated']:>6} {num(s['gpu_forward_s']):>8} "
            f"{num(s['gpu_stalls_s']):>7} {num(s['gather_stalls_s']):>8}"
        )
    lines.append(
        f"median step {rec['median_step_s']:.3f} s with its loop ({rec['tflops']:.1f} TFLOPS), "
        f"predicted {num(plan.get('predicted_step_s'))} s; CPU update {num(rec['cpu_Gps_in_step'], 2)} "
        f"G elements/s in the step, {num(rec['cpu_Gps_alone'], 2)} alone on the same arenas, "
        f"{num(rates.get('cpu_update_Gps'), 2)} priced by the plan (profile: "
        f"{num(rates.get('cpu_adam_alone_Gps'), 2)} alone, {num(rates.get('cpu_adam_Gps'), 2)} under copies)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", required=True, help="a preset (llama3-8b, llama2-13b, ...), a config.json or a model folder"
    )
    ap.add_argument(
        "--system", choices=("elixir", "elixir_trainer"), default="elixir", help="the harness's loop or Trainer.train()"
    )
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="default: the model's (2048 for decoders)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--clip", type=int, choices=(0, 1), default=1, help="clip to the Trainer's max_grad_norm (a host sync)"
    )
    ap.add_argument(
        "--offload", type=float, default=None, help="pin the offloaded fraction of chunks (default: the plan's)"
    )
    ap.add_argument(
        "--device-lane", choices=("off", "on", "auto"), default="off", help="ElixirConfig.device_assisted_update"
    )
    ap.add_argument(
        "--fused-head", action="store_true", help="the LM head's weight read outside its module, as TRL's fused head"
    )
    ap.add_argument(
        "--update-order",
        choices=("root_first", "chunk"),
        default="root_first",
        help="the CPU lane's order: the engine's (the root's chunks first) or plain chunk order, for an A/B",
    )
    ap.add_argument("--liger", action="store_true", help="the Trainer's use_liger_kernel (liger-kernel installed)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (the CPU Adam keeps one for the loop)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the record to this file")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1: a timed step waits for the update of the step before it")
    if args.system != "elixir" and (args.fused_head or args.update_order != "root_first"):
        ap.error("--fused-head and --update-order take the harness's loop: pass --system elixir")
    if args.liger and args.system != "elixir_trainer":
        ap.error("--liger is the Trainer's use_liger_kernel: pass --system elixir_trainer")
    rec = run(args)
    print(table(rec), flush=True)
    line = json.dumps(rec)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
