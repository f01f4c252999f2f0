"""``elixir-plan``: the plan ``--elixir auto`` would make, without a GPU and without allocating.

    elixir-plan --model gpt2-10b --seq-len 1024 --batch-size 8 --gpus 2 --gpu-mem 80GiB --host-mem 256GiB
    elixir-plan --model gpt2-10b --seq-len 1024 --batch-size 8 --hardware h100 --gpu-memory 40GiB  # a cap per GPU
    elixir-plan --model path/to/config.json --hardware hw.json --json
    elixir-plan --measure-hardware hw.json        # on the GPU machine: its profile, for planning elsewhere

The model is built from its config on the meta device, one training step is profiled on fake
tensors, and the search picks chunk size, rCache size and offloaded chunks for the given GPUs and
memory, through the same decision as ``--elixir auto`` (``search.auto.search_model``). The GPU's
rates come from ``--hardware`` (a shipped card: h100, or a profile file), else from this machine's
GPU; without a GPU, from the shipped H100 profile (said in the output): a GPU plan is never timed
with a CPU's rates. Printed: the profile and its time, the plan, and the rigid alternatives it beat.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from elixir_runtime.config import DEVICE_LANE_WORDS, ElixirConfig, resolve_dtype
from elixir_runtime.config import ConfigError, PlanError
from elixir_runtime.config import parse_size as config_parse_size
from elixir_runtime.plan import DEVICE_MEMORY, ElixirPlan, format_step_time, plan_model
from elixir_runtime.profiler import ModelProfile
from elixir_runtime.units import find_units, param_table
from elixir_runtime.hardware import HardwareProfile, load_hardware
from elixir_runtime.hardware.load import ENV_HARDWARE, SHIPPED
from elixir_runtime.search import Budget
from elixir_runtime.search.auto import search_model

from .loss import use_lean_loss
from .presets import PRESETS, canonical_name

__all__ = ["main", "PRESETS", "parse_size", "build_meta_model"]

GIB = 2**30


def parse_size(text: str) -> int:
    """``80GiB``, ``80G`` (binary), ``80GB`` (decimal), ``512MiB``; a bare number is GiB
    (``elixir_runtime.config.parse_size``, the rule of ``ElixirConfig.gpu_memory`` too)."""
    try:
        return config_parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_config(name: str, seq_len: int):
    """A preset, a ``config.json`` (or a directory holding one), or a Hub id (cached, or online)."""
    from transformers import AutoConfig

    preset = canonical_name(name)
    if preset is not None:
        family, kwargs = PRESETS[preset]
        if family == "gpt2":
            kwargs = {**kwargs, "n_positions": max(1024, seq_len), "vocab_size": 50257}
        return AutoConfig.for_model(family, **kwargs)
    path = Path(name)
    if path.is_file():
        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type"), **data)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"elixir-plan: {name!r} is not a preset ({', '.join(PRESETS)}), a config.json, or a Hub id that can be "
            f"loaded here ({type(exc).__name__}: {exc}); without network, download its config.json and pass its path"
        ) from exc


def build_meta_model(config, dtype: torch.dtype, checkpointing: bool) -> torch.nn.Module:
    """On the meta device, with sdpa attention (what a GPU run uses) where the model supports it,
    else the model's own implementation."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            # a copy: a refused attempt leaves its choice in the config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa")
        except ValueError as exc:  # "... does not support ... scaled_dot_product_attention"
            if "sdpa" not in str(exc) and "scaled_dot_product_attention" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _dtype(text: str) -> torch.dtype:
    try:
        return resolve_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gpu_memory(text: str) -> int:
    try:
        return ElixirConfig(gpu_memory=text).gpu_memory
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elixir-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--model_config", "--model-config", dest="model", help="preset, config.json or Hub id")
    p.add_argument("--seq-len", "--seq_len", type=_positive, default=1024)
    p.add_argument("--batch-size", "--batch_size", type=_positive, default=8, help="per GPU")
    p.add_argument("--grad-accum", "--grad_accum", type=_positive, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gpus", type=_positive, default=1, help="GPUs (ranks) on one host")
    p.add_argument("--gpu-mem", "--gpu_mem", type=parse_size, help="memory per GPU (default: the hardware profile's)")
    p.add_argument("--gpu-memory", "--gpu_memory", type=_gpu_memory, help="ElixirConfig.gpu_memory: the most GPU memory "
                   "the run may use per GPU (a GPU shared with other jobs, headroom); at most the card's")
    p.add_argument("--host-mem", "--host_mem", type=parse_size, help="host RAM (default: the hardware profile's)")
    p.add_argument("--hardware", help=f"a shipped card ({', '.join(SHIPPED)}) or a hardware profile JSON (default: this "
                   "machine's GPU, measured once and cached; without a GPU the shipped h100)")
    p.add_argument("--dtype", default="bf16", type=_dtype, help="compute dtype: bf16, fp16 or fp32")
    p.add_argument("--no-ac", dest="ac", action="store_false", help="without activation checkpointing")
    p.add_argument("--device-lane", choices=tuple(DEVICE_LANE_WORDS), default="off",
                   help="the device update lane (ElixirConfig.device_assisted_update): off (default), on, or auto "
                        "(kept where the predicted step is shorter)")
    p.add_argument("--stock-loss", "--stock_loss", dest="lean_loss", action="store_false",
                   help="plan for transformers' own causal-LM loss (--elixir '{\"lean_loss\": false}'); default: the "
                        "lean loss an Elixir run installs (elixir_hf/loss.py), without fp32 copies of the logits")
    p.add_argument("--exact", action="store_true", help="trace every block instead of replaying identical ones")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--plot", help="write placement and memory budget as a PNG")
    p.add_argument("--measure-hardware", metavar="PATH", help="measure this machine, write its profile to PATH, exit "
                   "(CPU Adam per rank for 1, 2, 4, 8 and all its GPUs' ranks, each count by as many processes at once)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.measure_hardware:
        return _measure(args.measure_hardware)
    if not args.model:
        _parser().error("--model is required (or --measure-hardware)")
    try:
        args.hardware_profile, args.hardware_note = _hardware(args.hardware)
    except (OSError, ValueError) as exc:
        _parser().error(f"--hardware {args.hardware}: {exc}")
    try:
        report = plan_report(args)
    except PlanError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}, indent=2))
        else:
            print(f"elixir-plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report["json"], indent=2))
    else:
        print(report["text"])
    if args.plot:
        plot_plan(report["plan"], report["budget"], args.plot, title=report["title"])
    return 0


def _measure(path: str) -> int:
    from elixir_runtime.hardware.measure import measure_hardware

    profile = measure_hardware()
    profile.save(path)
    print(profile.to_json())
    print(f"written to {path} ({profile.source})", file=sys.stderr)
    return 0


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``main`` prints: the texts, the JSON document, the plan and its budget."""
    dtype = args.dtype
    hardware, hw_note = args.hardware_profile, args.hardware_note
    card = args.gpu_mem or hardware.gpu_memory
    cap = args.gpu_memory
    if cap is not None and cap > card:
        raise PlanError(
            f"--gpu-memory {cap / GIB:.2f} GiB is more than the {card / GIB:.2f} GiB of the GPU planned for "
            f"({'--gpu-mem' if args.gpu_mem else hardware.device}): give at most {card} bytes, or plan for a larger "
            "card (--gpu-mem, or --hardware with its profile)"
        )
    t0 = time.perf_counter()
    config = model_config(args.model, args.seq_len)
    model = build_meta_model(config, dtype, args.ac)
    if args.lean_loss:  # as build_engine does
        use_lean_loss(model)
    build_s = time.perf_counter() - t0
    units = find_units(model, None)
    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")

    def budget_of(profile: ModelProfile) -> Budget:
        return Budget(
            capacity=card if cap is None else cap,
            activations=profile.activation_peak,
            buffers=profile.buffer_bytes,
            host_capacity=args.host_mem or hardware.host_memory,
            ranks_per_host=args.gpus,
            limit=cap,
        )

    t1 = time.perf_counter()
    elixir = ElixirConfig(dtype=dtype, gpu_memory=cap, device_assisted_update=DEVICE_LANE_WORDS[args.device_lane],
                          grad_accum_steps=args.grad_accum)
    gpu = torch.device("cuda")
    order, result, profile = search_model(
        model, units, {"input_ids": ids, "labels": ids}, elixir, gpu, dtype, args.gpus, hardware, budget_of,
        exact=args.exact,
    )
    budget = result.budget
    _, _, plan = plan_model(
        param_table(model, units, order), elixir, world_size=args.gpus, device=gpu, dtype=dtype, search=result, check=False
    )
    search_s = time.perf_counter() - t1 - profile.seconds

    capped = "" if cap is None else f" capped at {cap / GIB:.1f} (--gpu-memory)"
    title = (f"{args.model}: batch {args.batch_size} x seq {args.seq_len} per GPU, {args.gpus} GPU(s) of "
             f"{card / GIB:.0f} GiB{capped}, host {budget.host_capacity / GIB:.0f} GiB, AC {'on' if args.ac else 'off'}")
    timings = {"build_s": build_s, "profile_s": profile.seconds, "search_s": search_s}
    text = "\n\n".join(
        [
            title,
            "== profile ==\n" + profile.summary(),
            f"== hardware ==\n{hardware.device}: {hardware.source}" + (f"\n{hw_note}" if hw_note else ""),
            "== plan ==\n" + plan.table(),
            "== alternatives (same chunks) ==\n" + _alternatives_table(plan, budget),
            f"model built in {build_s:.2f} s, profiled in {profile.seconds:.2f} s, searched "
            f"{len(result.candidates)} chunk sizes in {search_s:.2f} s" + "".join(f"\nnote: {n}" for n in result.notes),
        ]
    )
    doc = {
        "model": args.model,
        "settings": {
            k: str(v).removeprefix("torch.") if k == "dtype" else v
            for k, v in vars(args).items()
            if k not in ("json", "plot", "measure_hardware", "hardware_profile", "hardware_note")
        },
        "profile": _profile_json(profile),
        "hardware": {"device": hardware.device, "source": hardware.source, "note": hw_note},
        "plan": asdict(plan),
        "timings": timings,
    }
    return {"text": text, "json": doc, "plan": plan, "budget": budget, "title": title}


def _hardware(name: str | None) -> tuple[HardwareProfile, str]:
    """The GPU profile to plan with, and a note saying where it comes from when it is not this machine's."""
    note = ""
    if name is None and not os.environ.get(ENV_HARDWARE) and not torch.cuda.is_available():
        name = "h100"
        note = (
            "no GPU here and no --hardware: planned for the shipped H100 profile (GPU times and memory of that card). "
            "For another card, run `elixir-plan --measure-hardware hw.json` on it and pass --hardware hw.json."
        )
    hardware = load_hardware(name)
    if hardware.cpu_only:
        raise ValueError(
            f"{hardware.source or 'the profile'} was measured on a CPU (device 'cpu'): a GPU plan needs a GPU's rates; "
            f"pass --hardware {'|'.join(SHIPPED)} or a profile measured with --measure-hardware on the GPU machine"
        )
    return hardware, note


def _profile_json(profile: ModelProfile) -> dict[str, Any]:
    return {
        "parameters": profile.n_params,
        "parameter_bytes": profile.param_bytes,
        "buffer_bytes": profile.buffer_bytes,
        "activation_peak": profile.activation_peak,
        "peak_at": profile.peak_at,
        "forward_peak": profile.forward_peak,
        "saved_bytes": profile.saved_bytes,
        "late_peak": profile.late_peak,
        "head_params": profile.head_params,
        "ac_regions": len(profile.ac_regions),
        "ac_buffer_numel": profile.ac_buffer_numel(),
        "tied": [p.name for p in profile.params if p.aliases],
        "flops": {k: c.total_flops for k, c in profile.compute.items()},
        "blocks": asdict(profile.blocks) if profile.blocks else None,
        "device": profile.device,
        "seconds": profile.seconds,
    }


def _alternatives_table(plan: ElixirPlan, budget: Budget) -> str:
    rows = [("elixir (chosen)", plan.n_blocks, len(plan.offload), plan.device_bytes, plan.host_bytes, True, plan.predicted)]
    rows += [(a["name"], a["n_blocks"], a["offloaded"], a["device_bytes"], a["host_bytes"], a["fits"], a["time"])
             for a in plan.alternatives]
    head = f"{'plan':<18} {'blocks':>6} {'offloaded':>9} {'GPU GiB':>8} {'host GiB':>8} {'fits':>5} {'step s':>8}  breakdown"
    lines = [head]
    for name, blocks, off, dev, host, fits, t in rows:
        lines.append(
            f"{name:<18} {blocks:>6} {off:>9} {dev / GIB:>8.2f} {host / GIB:>8.2f} {'yes' if fits else 'NO':>5} "
            f"{t['total']:>8.3f}  {format_step_time(t)}"
        )
    lines.append(f"budget per rank: {budget.allowed / GIB:.2f} GiB GPU (U_allowed), {budget.host_allowed / GIB:.2f} GiB host")
    return "\n".join(lines)


_BARS = {
    "rcache": ("rCache", "tab:blue"),
    "private": ("private blocks", "tab:purple"),
    "device_shards": ("GPU-resident shards", "tab:green"),
    "device_grads": ("their gradients beyond the activations' slack", "tab:olive"),
    "lane_staging": ("device-lane staging", "tab:cyan"),
}
"""Label and colour of each of the plan's ``DEVICE_MEMORY`` parts in the plot."""


def memory_bars(plan: ElixirPlan, budget: Budget) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) of the plot's GPU bar, left to right: the plan's ``DEVICE_MEMORY``
    (what ``U_allowed`` bounds; gradient shards beyond the activation memory freed under them), then
    the activation budget and buffers. Empty parts are left out."""
    parts = [(_BARS[k][0], plan.memory.get(k, 0), _BARS[k][1]) for k in DEVICE_MEMORY]
    parts += [
        (f"activations x {budget.f_frag}", int(budget.f_frag * plan.memory.get("activations", 0)), "tab:orange"),
        ("buffers", plan.memory.get("buffers", 0), "tab:gray"),
    ]
    return [part for part in parts if part[1] > 0]


def plot_plan(plan: ElixirPlan, budget: Budget, path: str, title: str = "") -> None:
    """Two panels: the GPU memory budget of one rank, and where every chunk lives."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, chunk_ax) = plt.subplots(2, 1, figsize=(11, 5.5), gridspec_kw={"height_ratios": [1, 1]})
    left = 0.0
    for label, size, color in memory_bars(plan, budget):
        mem_ax.barh(0, size / GIB, left=left, color=color, label=f"{label} {size / GIB:.1f}")
        left += size / GIB
    mem_ax.axvline(budget.capacity / GIB, color="black", label=f"capacity {budget.capacity / GIB:.1f}")
    mem_ax.axvline(budget.allowed / GIB, color="red", linestyle="--",
                   label=f"U_allowed {budget.allowed / GIB:.1f}: model states end before it")
    mem_ax.set_yticks([])
    mem_ax.set_xlabel("GiB per GPU")
    mem_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8)
    mem_ax.set_title(title, fontsize=9)
    off = set(plan.offload)
    colors = ["tab:red" if i in off else "tab:green" for i in range(plan.n_chunks)]
    chunk_ax.bar(range(plan.n_chunks), [1] * plan.n_chunks, width=1.0, color=colors, edgecolor="white", linewidth=0.3)
    chunk_ax.set_yticks([])
    chunk_ax.set_xlim(-0.5, plan.n_chunks - 0.5)
    chunk_ax.set_xlabel(
        f"chunk (forward order): green = shard + optimizer state on the GPU, red = offloaded to pinned host memory; "
        f"rCache {plan.n_blocks} blocks of {plan.chunk_size / 2**20:.0f} Mi elements",
        fontsize=8,
    )
    if plan.predicted:
        chunk_ax.set_title(f"predicted step {plan.predicted['total']:.3f} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
