"""What ``elixir-plan`` prints: the model built on meta, its plan from the planner, the texts and the JSON.

The plan comes from ``elixir_runtime.planner.plan_model``, the decision ``--elixir auto`` makes, for
a GPU described by a hardware profile and the memory the command line gives.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from elixir_runtime.config import ElixirConfig, PlanError
from elixir_runtime.hardware import HardwareProfile
from elixir_runtime.plan import ElixirPlan, format_step_time
from elixir_runtime.planner import Target, plan_model
from elixir_runtime.profiler import ModelProfile
from elixir_runtime.search import Budget, StepTime
from elixir_runtime.units import find_units

from .loss import use_lean_loss
from .presets import PRESETS, canonical_name

__all__ = ["PlanReport", "plan_report", "model_config", "build_meta_model"]

GIB = 2**30


@dataclass
class PlanReport:
    """Everything ``elixir-plan`` prints, and the plan behind it."""

    plan: ElixirPlan
    title: str
    text: str
    """The tables: profile, hardware, plan, alternatives, timings and notes."""
    doc: dict[str, Any]
    """The ``--json`` document (``model``, ``settings``, ``profile``, ``hardware``, ``plan``, ``timings``)."""


def plan_report(
    args: argparse.Namespace, config: ElixirConfig, hardware: HardwareProfile, hw_note: str = ""
) -> PlanReport:
    """The plan for ``args`` (the parsed command line) and ``config`` (what it asks of the engine) on
    ``hardware``; ``hw_note``: where the hardware profile comes from when it is not this machine's."""
    card = args.gpu_mem or hardware.gpu_memory
    _check_cap(args, hardware, card)
    t0 = time.perf_counter()
    model = build_meta_model(model_config(args.model, args.seq_len), args.dtype, args.ac)
    if args.lean_loss:  # as build_engine does
        use_lean_loss(model)
    build_s = time.perf_counter() - t0
    ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    plan = plan_model(model, find_units(model, None), {"input_ids": ids, "labels": ids}, config,
                      _target(args, hardware, card), exact=args.exact)
    timings = {"build_s": build_s, "profile_s": plan.profile.seconds,
               "search_s": time.perf_counter() - t1 - plan.profile.seconds}
    title = _title(args, card, plan.budget)
    text = _text(title, plan, hardware, hw_note, timings)
    return PlanReport(plan, title, text, _doc(args, plan, hardware, hw_note, timings))


def _check_cap(args: argparse.Namespace, hardware: HardwareProfile, card: int) -> None:
    cap = args.gpu_memory
    if cap is not None and cap > card:
        raise PlanError(
            f"--gpu-memory {cap / GIB:.2f} GiB is more than the {card / GIB:.2f} GiB of the GPU planned for "
            f"({'--gpu-mem' if args.gpu_mem else hardware.device}): give at most {card} bytes, or plan for a larger "
            "card (--gpu-mem, or --hardware with its profile)"
        )


def _target(args: argparse.Namespace, hardware: HardwareProfile, card: int) -> Target:
    """``args.gpus`` GPUs of ``card`` bytes (capped at ``--gpu-memory``) on one host."""
    cap = args.gpu_memory

    def budget(profile: ModelProfile) -> Budget:
        return Budget(
            capacity=card if cap is None else cap,
            activations=profile.activation_peak,
            buffers=profile.buffer_bytes,
            host_capacity=args.host_mem or hardware.host_memory,
            ranks_per_host=args.gpus,
            limit=cap,
        )

    return Target(args.gpus, torch.device("cuda"), args.dtype, hardware, budget)


def _title(args: argparse.Namespace, card: int, budget: Budget) -> str:
    capped = "" if args.gpu_memory is None else f" capped at {args.gpu_memory / GIB:.1f} (--gpu-memory)"
    return (f"{args.model}: batch {args.batch_size} x seq {args.seq_len} per GPU, {args.gpus} GPU(s) of "
            f"{card / GIB:.0f} GiB{capped}, host {budget.host_capacity / GIB:.0f} GiB, AC {'on' if args.ac else 'off'}")


def _text(title: str, plan: ElixirPlan, hardware: HardwareProfile, hw_note: str, timings: dict[str, float]) -> str:
    notes = "".join(f"\nnote: {n}" for n in plan.search["notes"])
    return "\n\n".join([
        title,
        "== profile ==\n" + plan.profile.summary(),
        f"== hardware ==\n{hardware.device}: {hardware.source}" + (f"\n{hw_note}" if hw_note else ""),
        "== plan ==\n" + plan.table(),
        "== alternatives (same chunks) ==\n" + _alternatives_table(plan),
        f"model built in {timings['build_s']:.2f} s, profiled in {timings['profile_s']:.2f} s, searched "
        f"{len(plan.search['candidates'])} chunk sizes in {timings['search_s']:.2f} s" + notes,
    ])


def _doc(args: argparse.Namespace, plan: ElixirPlan, hardware: HardwareProfile, hw_note: str,
         timings: dict[str, float]) -> dict[str, Any]:
    return {
        "model": args.model,
        "settings": {
            k: str(v).removeprefix("torch.") if k == "dtype" else v
            for k, v in vars(args).items()
            if k not in ("json", "plot", "measure_hardware")
        },
        "profile": _profile_json(plan.profile),
        "hardware": {"device": hardware.device, "source": hardware.source, "note": hw_note},
        "plan": plan.to_dict(),
        "timings": timings,
    }


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


def _alternatives_table(plan: ElixirPlan) -> str:
    rows = [("elixir (chosen)", plan.n_blocks, len(plan.offload), plan.device_bytes, plan.host_bytes, True, plan.predicted)]
    rows += [(a["name"], a["n_blocks"], a["offloaded"], a["device_bytes"], a["host_bytes"], a["fits"],
              StepTime.from_dict(a["time"])) for a in plan.alternatives]
    head = f"{'plan':<18} {'blocks':>6} {'offloaded':>9} {'GPU GiB':>8} {'host GiB':>8} {'fits':>5} {'step s':>8}  breakdown"
    lines = [head]
    for name, blocks, off, dev, host, fits, t in rows:
        lines.append(
            f"{name:<18} {blocks:>6} {off:>9} {dev / GIB:>8.2f} {host / GIB:>8.2f} {'yes' if fits else 'NO':>5} "
            f"{t.total:>8.3f}  {format_step_time(t)}"
        )
    budget = plan.budget
    lines.append(f"budget per rank: {budget.allowed / GIB:.2f} GiB GPU (U_allowed), {budget.host_allowed / GIB:.2f} GiB host")
    return "\n".join(lines)


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
