"""What ``elixir-plan`` prints: the model built on meta, its plan from the planner, the texts and the JSON.

The plan comes from ``elixir_runtime.planner.plan_model``, the decision ``--elixir auto`` makes, for
a GPU described by a hardware profile and the memory the command line gives. The default text says
what a user decides on (memory per GPU and host, what is offloaded and why, the predicted step);
``--verbose`` adds the planner's own terms (profile, budget formula, I(n)/J(n), every chunk size
tried, the rigid alternatives).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from elixir_runtime.config import ElixirConfig, PlanError
from elixir_runtime.hardware import HardwareProfile
from elixir_runtime.planner import (
    Budget,
    ElixirPlan,
    ModelProfile,
    StepTime,
    Target,
    find_units,
    format_step_time,
    plan_model,
)

from ..loss import use_lean_loss
from ..presets import PRESETS, canonical_name
from .plan_hardware import host_memory

__all__ = [
    "PlanReport",
    "plan_report",
    "chunk_layers",
    "describe_layers",
    "model_config",
    "build_meta_model",
]

GIB = 2**30
HOST_BOUND = 0.25
"""Share of the predicted step that CPU updates not hidden must reach for ``elixir-plan`` to price
two micro-batches per step, which hide them under twice the compute (``_accumulated``)."""


@dataclass
class PlanReport:
    """Everything ``elixir-plan`` prints, and the plan behind it."""

    plan: ElixirPlan
    title: str
    text: str
    """The default text: memory per GPU and host, offloaded chunks and why, predicted step."""
    details: str
    """What ``--verbose`` adds: profile, hardware and rates, the plan table, the budget formula,
    alternatives, every chunk size tried, timings and the search's notes."""
    doc: dict[str, Any]
    """The ``--json`` document (``model``, ``settings``, ``profile``, ``hardware``, ``plan``, ``timings``)."""


def plan_report(
    args: argparse.Namespace, config: ElixirConfig, hardware: HardwareProfile, hw_note: str = ""
) -> PlanReport:
    """The plan for ``args`` (the parsed command line) and ``config`` (what it asks of the engine) on
    ``hardware``; ``hw_note``: where the hardware profile comes from when it is not this machine's."""
    card = args.gpu_mem or hardware.gpu_memory
    _check_cap(args, hardware, card)
    host_bytes, host_source = host_memory(args, hardware)
    t0 = time.perf_counter()
    with quiet_transformers():  # its warnings about use_cache, token ids, ... say nothing about the plan
        model = build_meta_model(model_config(args.model, args.seq_len), args.dtype, args.ac)
        if args.lean_loss:  # as build_engine does
            use_lean_loss(model)
        build_s = time.perf_counter() - t0
        ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
        units, batch, target = (
            find_units(model, None),
            {"input_ids": ids, "labels": ids},
            _target(args, hardware, card, host_bytes),
        )

        def plan_for(cfg: ElixirConfig) -> ElixirPlan:
            return plan_model(model, units, batch, cfg, target, exact=args.exact)

        t1 = time.perf_counter()
        try:
            plan = plan_for(config)
        except PlanError as exc:
            if isinstance(args.host_mem, int):
                raise
            raise PlanError(
                f"{exc}\n(host memory: {_size(host_bytes)}, {host_source}; --host-mem to plan for another host)"
            ) from exc
        timings = {
            "build_s": build_s,
            "profile_s": plan.profile.seconds,
            "search_s": time.perf_counter() - t1 - plan.profile.seconds,
        }
        accumulated = _accumulated(args, config, plan, plan_for)
    title = _title(args, card, plan.budget)
    text = _text(args, plan, hardware, hw_note, card, host_source, accumulated)
    details = _details(plan, hardware, hw_note, timings)
    doc = _doc(args, plan, hardware, hw_note, host_source, timings)
    if accumulated is not None:
        doc["accumulated"] = {
            "grad_accum": 2,
            "predicted_step_s": accumulated.predicted.total,
            "tflops": _tflops(args, accumulated, 2),
        }
    return PlanReport(plan, title, text, details, doc)


def _accumulated(
    args: argparse.Namespace, config: ElixirConfig, plan: ElixirPlan, plan_for: Callable[[ElixirConfig], ElixirPlan]
) -> ElixirPlan | None:
    """Where the step is host-bound (``HOST_BOUND``) with one micro-batch per step, the plan for two:
    the CPU update of offloaded chunks is per optimizer step, so twice the tokens hide more of it.
    ``None`` otherwise, or where two do not fit."""
    t = plan.predicted
    if args.grad_accum > 1 or t is None or t.exposed_cpu_adam < HOST_BOUND * t.total:
        return None
    try:
        return plan_for(replace(config, grad_accum_steps=2))
    except PlanError:
        return None


def _tflops(args: argparse.Namespace, plan: ElixirPlan, micro_batches: int) -> float:
    """8 x parameters x tokens per optimizer step / the predicted step (per GPU)."""
    return 8 * plan.profile.n_params * args.batch_size * args.seq_len * micro_batches / plan.predicted.total / 1e12


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level inside (its own verbosity switch), restored after."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _check_cap(args: argparse.Namespace, hardware: HardwareProfile, card: int) -> None:
    cap = args.gpu_memory
    if cap is not None and cap > card:
        raise PlanError(
            f"--gpu-memory {cap / GIB:.2f} GiB is more than the {card / GIB:.2f} GiB of the GPU planned for "
            f"({'--gpu-mem' if args.gpu_mem else hardware.device}): give at most {card} bytes, or plan for a larger "
            "card (--gpu NAME, --gpu-mem, or --hardware with its profile)"
        )


def _target(args: argparse.Namespace, hardware: HardwareProfile, card: int, host_bytes: int) -> Target:
    """``args.gpus`` GPUs of ``card`` bytes (capped at ``--gpu-memory``) on one host of ``host_bytes``."""
    cap = args.gpu_memory

    def budget(profile: ModelProfile) -> Budget:
        return Budget(
            capacity=card if cap is None else cap,
            activations=profile.activation_peak,
            buffers=profile.buffer_bytes,
            host_capacity=host_bytes,
            ranks_per_host=args.gpus,
            limit=cap,
        )

    return Target(args.gpus, torch.device("cuda"), args.dtype, hardware, budget)


def _title(args: argparse.Namespace, card: int, budget: Budget) -> str:
    capped = "" if args.gpu_memory is None else f" capped at {args.gpu_memory / GIB:.1f} (--gpu-memory)"
    gpus = f"{args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    return (
        f"{args.model}: batch {args.batch_size} x {args.seq_len} tokens per GPU, {gpus} of {card / GIB:.0f} GiB"
        f"{capped}, host {budget.host_capacity / GIB:.0f} GiB, checkpointing {'on' if args.ac else 'off'}"
    )


# --------------------------------------------------------------------------- the default text


def _text(
    args: argparse.Namespace,
    plan: ElixirPlan,
    hardware: HardwareProfile,
    hw_note: str,
    card: int,
    host_source: str,
    accumulated: ElixirPlan | None = None,
) -> str:
    """The default output: what was planned for, memory per GPU and host, what is offloaded, the step
    (and, where it is host-bound, the step of two micro-batches)."""
    return "\n\n".join(
        [
            _header(args, plan, hardware, hw_note, card, host_source),
            "\n".join([*_gpu_memory(plan), _host_memory(plan), "offloaded: " + _offload_text(plan)]),
            _step_text(args, plan) + ("\n" + _accumulated_text(plan, accumulated, args) if accumulated else ""),
        ]
    )


def _accumulated_text(plan: ElixirPlan, accumulated: ElixirPlan, args: argparse.Namespace) -> str:
    t, t2 = plan.predicted, accumulated.predicted
    return (
        f"  host-bound: {t.exposed_cpu_adam:.3f} s of it is the CPU update of offloaded chunks, once per optimizer "
        f"step whatever its tokens; with 2 micro-batches per step (--grad-accum 2; the Trainer's "
        f"gradient_accumulation_steps) the plan predicts {t2.total:.3f} s for twice the tokens, "
        f"{_tflops(args, accumulated, 2):.0f} TFLOPS per GPU"
    )


def _header(
    args: argparse.Namespace, plan: ElixirPlan, hardware: HardwareProfile, hw_note: str, card: int, host_source: str
) -> str:
    gpus = f"{args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    accum = f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    cap = plan.budget.limit
    memory = _size(card) if cap is None else f"{_size(cap)} of its {_size(card)} (--gpu-memory)"
    gpu_source = hw_note or f"this machine's GPU ({hardware.source})"
    return "\n".join(
        [
            f"{args.model}: {plan.profile.n_params / 1e9:.3f} B parameters, batch {args.batch_size} x {args.seq_len} "
            f"tokens per GPU{accum}, {gpus}, {plan.dtype}, activation checkpointing {'on' if args.ac else 'off'}",
            f"planned batch shape: {plan.batch_shape} (batch_shape in the plan; a run's larger batches warn)",
            f"GPU:  {hardware.device}, {memory}; {gpu_source}",
            f"host: {_size(plan.budget.host_capacity)} RAM, {host_source}",
        ]
    )


def _gpu_memory(plan: ElixirPlan) -> list[str]:
    """One GPU's memory by part, in words; the optional parts only where the plan has them."""
    memory = plan.memory
    rows = [  # (name, bytes, what it is, shown when empty)
        (
            "model states on the GPU",
            memory.device_shards + memory.device_grads,
            "this GPU's share of weights, gradients and Adam state",
            True,
        ),
        (
            "gathered-parameter cache",
            memory.rcache + memory.private,
            f"{plan.n_blocks} blocks of {plan.chunk_size / 1e6:.1f} M parameters (rCache)"
            + (" and tied or oversize weights" if memory.private else ""),
            True,
        ),
        ("update-lane staging", memory.lane_staging, "the GPU updates slices of offloaded chunks", False),
        ("activations (peak)", memory.activations or 0, f"at {plan.profile.peak_at}", True),
        ("buffers", memory.buffers or 0, "the model's buffers", False),
    ]
    rows = [row for row in rows if row[1] or row[3]]
    width = max(len(name) for name, *_ in rows) + 2
    capacity = plan.budget.capacity
    return [f"GPU memory per GPU: {_size(plan.device_peak_bytes)} of {_size(capacity)}"] + [
        f"  {name:<{width}}{_size(size):>10}  {what}" for name, size, what, _ in rows
    ]


def _host_memory(plan: ElixirPlan) -> str:
    ranks, pinned = plan.budget.ranks_per_host, plan.host_bytes
    usable = _size(plan.budget.host_allowed * ranks)
    if not pinned:
        return f"host memory: nothing pinned ({usable} usable for offloaded chunks)"
    both = f", {_size(pinned * ranks)} for the {ranks} GPUs" if ranks > 1 else ""
    return f"host memory: {_size(pinned)} pinned per GPU{both}, of {usable} usable"


def _size(n: int) -> str:
    """``71.3 GiB``; below 1 GiB ``512.0 MiB`` (a small model's parts are not all zeros)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB or n == 0 else f"{n / 2**20:.1f} MiB"


def _offload_text(plan: ElixirPlan) -> str:
    """Which chunks live in host memory, which layers they hold, and why."""
    if not plan.offload:
        return f"nothing: all {plan.n_chunks} chunks keep weights, gradients and Adam state on the GPU"
    layers = describe_layers(n for i in plan.offload for n in _chunk_names(plan, i))
    text = (
        f"{len(plan.offload)} of {plan.n_chunks} chunks ({layers}) keep their weights and Adam state in pinned "
        "host memory; the CPU updates them while the GPU computes"
    )
    on_gpu = [a for a in plan.alternatives if a["name"] in ("rcache-min", "rcache-max") and not a["offloaded"]]
    smallest = min(on_gpu, key=lambda a: a["device_bytes"], default=None)
    if smallest is not None and not smallest["fits"]:
        text += (
            f"\n  why: keeping every chunk on the GPU needs {_size(smallest['device_bytes'])} per GPU for "
            f"model states and cache, more than the {_size(plan.budget.allowed)} the GPU has for them "
            "beside the activations"
        )
    return text


def _step_text(args: argparse.Namespace, plan: ElixirPlan) -> str:
    t = plan.predicted
    tflops = _tflops(args, plan, args.grad_accum)
    parts = [f"compute {t.compute:.3f} s"]
    parts += [
        f"{name} {v:.3f} s"
        for name, v in (
            ("transfers not hidden", t.exposed_transfers),
            ("Adam on the GPU", t.gpu_adam),
            ("CPU Adam not hidden", t.exposed_cpu_adam),
        )
        if v >= 0.0005
    ]
    rigid = {a["name"]: a for a in plan.alternatives}
    zero = [
        f"{label} {rigid[k]['time']['total']:.3f} s"
        for k, label in (
            ("zero2-offload-all", "ZeRO-2-like offload-all"),
            ("zero3-offload-all", "ZeRO-3-like offload-all"),
        )
        if k in rigid
    ]
    return "\n".join(
        [
            f"predicted step: {t.total:.3f} s per optimizer step ({', '.join(parts)})",
            f"  {tflops:.{0 if tflops >= 100 else 1 if tflops >= 1 else 3}f} TFLOPS per GPU (8 x parameters x tokens / step time)"
            + (f"; for comparison {', '.join(zero)}" if zero else ""),
        ]
    )


# --------------------------------------------------------------------------- layers of chunks

_BLOCK = re.compile(r"^(?:.*\.)?([^.]+)\.(\d+)\.")


def describe_layers(names: Iterable[str]) -> str:
    """Parameter names in short: the numbered blocks as ranges (``h.0-3``, ``layers.12``), the
    other modules by their last name (``wte``, ``lm_head``), in first-seen order."""
    blocks: dict[str, list[int]] = {}
    parts: dict[str, None] = {}
    for name in names:
        m = _BLOCK.match(name)
        if m:
            stack, index = m.group(1), int(m.group(2))
            parts.setdefault(stack, None)
            blocks.setdefault(stack, []).append(index)
        else:
            module = name.rsplit(".", 1)[0] if "." in name else name
            parts.setdefault(module.rsplit(".", 1)[-1], None)
    out = []
    for part in parts:
        if part in blocks:
            out.append(f"{part}.{_ranges(sorted(set(blocks[part])))}")
        else:
            out.append(part)
    return ", ".join(out)


def _ranges(indices: list[int]) -> str:
    runs, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def _chunk_names(plan: ElixirPlan, index: int) -> list[str]:
    layout = plan.layout
    return [layout.names[s.param][0] for s in layout.chunks[index].slots]


def chunk_layers(plan: ElixirPlan) -> list[str]:
    """What each chunk holds, in short (``describe_layers``); empty names for a plan read from a file."""
    if plan.layout is None:
        return [""] * plan.n_chunks
    return [describe_layers(_chunk_names(plan, i)) for i in range(plan.n_chunks)]


# --------------------------------------------------------------------------- --verbose


def _details(plan: ElixirPlan, hardware: HardwareProfile, hw_note: str, timings: dict[str, float]) -> str:
    notes = "".join(f"\nnote: {n}" for n in plan.search["notes"])
    return "\n\n".join(
        [
            "== profile ==\n" + plan.profile.summary(),
            f"== hardware ==\n{hardware.device}: {hardware.source}" + (f"\n{hw_note}" if hw_note else ""),
            "== plan ==\n" + plan.table(verbose=True),
            "== memory budget per GPU ==\n" + _budget_text(plan.budget),
            "== alternatives (same chunks) ==\n" + _alternatives_table(plan),
            "== chunk sizes tried ==\n" + _candidates_table(plan),
            f"model built in {timings['build_s']:.2f} s, profiled in {timings['profile_s']:.2f} s, searched "
            f"{len(plan.search['candidates'])} chunk sizes in {timings['search_s']:.2f} s" + notes,
        ]
    )


def _budget_text(budget: Budget) -> str:
    g = GIB
    return "\n".join(
        [
            f"U_allowed = F_alloc x (capacity - U_buffer - F_frag x U_act) = {budget.f_alloc} x ({budget.capacity / g:.2f} "
            f"- {budget.buffers / g:.2f} - {budget.f_frag} x {budget.activations / g:.2f}) = {budget.allowed / g:.2f} GiB "
            "for model states and rCache",
            f"host: F_host x host memory / GPUs per host = {budget.f_host} x {budget.host_capacity / g:.2f} / "
            f"{budget.ranks_per_host} = {budget.host_allowed / g:.2f} GiB pinned per GPU",
        ]
    )


def _candidates_table(plan: ElixirPlan) -> str:
    head = f"{'chunk size':>12} {'chunks':>6} {'min blocks':>10} {'blocks':>6} {'offloaded':>9} {'step s':>8}"
    lines = [head]
    for c in plan.search["candidates"]:
        fits = c["step_s"] is not None
        lines.append(
            f"{c['chunk_size']:>12,} {c['n_chunks']:>6} {c['min_blocks']:>10} "
            + (
                f"{c['n_blocks']:>6} {c['offloaded']:>9} {c['step_s']:>8.3f}"
                if fits
                else f"{'-':>6} {'-':>9} {'no fit':>8}"
            )
            + ("  <- chosen" if c["chunk_size"] == plan.chunk_size else "")
        )
    return "\n".join(lines)


def _doc(
    args: argparse.Namespace,
    plan: ElixirPlan,
    hardware: HardwareProfile,
    hw_note: str,
    host_source: str,
    timings: dict[str, float],
) -> dict[str, Any]:
    return {
        "model": args.model,
        "settings": {
            k: str(v).removeprefix("torch.") if k == "dtype" else v
            for k, v in vars(args).items()
            if k not in ("json", "plot", "measure_hardware", "verbose")
        },
        "profile": _profile_json(plan.profile),
        "hardware": {"device": hardware.device, "source": hardware.source, "note": hw_note},
        "host": {"memory": plan.budget.host_capacity, "source": host_source},
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
    rows = [
        ("elixir (chosen)", plan.n_blocks, len(plan.offload), plan.device_bytes, plan.host_bytes, True, plan.predicted)
    ]
    rows += [
        (
            a["name"],
            a["n_blocks"],
            a["offloaded"],
            a["device_bytes"],
            a["host_bytes"],
            a["fits"],
            StepTime.from_dict(a["time"]),
        )
        for a in plan.alternatives
    ]
    head = f"{'plan':<18} {'blocks':>6} {'offloaded':>9} {'GPU GiB':>8} {'host GiB':>8} {'fits':>5} {'step s':>8}  breakdown"
    lines = [head]
    for name, blocks, off, dev, host_b, fits, t in rows:
        lines.append(
            f"{name:<18} {blocks:>6} {off:>9} {dev / GIB:>8.2f} {host_b / GIB:>8.2f} {'yes' if fits else 'NO':>5} "
            f"{t.total:>8.3f}  {format_step_time(t)}"
        )
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

    with torch.device("meta"):
        try:
            # a copy: a refused attempt leaves its choice in the config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa")
        except ValueError as exc:  # "... does not support ... scaled_dot_product_attention"
            if "sdpa" not in str(exc) and "scaled_dot_product_attention" not in str(exc):
                raise
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if checkpointing:  # activation_checkpointing_enable: transformers >= 5.2x's name, the old one warns
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
