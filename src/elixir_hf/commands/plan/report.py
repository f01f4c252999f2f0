"""What ``elixir-plan`` prints: the model built on meta, its plan from the planner, the texts and the JSON.

The plan comes from ``elixir_runtime.planner.plan_model``, the decision ``--elixir auto`` makes, for
a GPU described by a hardware profile and the memory the command line gives. The default text says
what a user decides on (memory per GPU and host, what is offloaded and why, the predicted step);
``--verbose`` adds the planner's own terms (profile, budget formula, I(n)/J(n), every chunk size
tried, the rigid alternatives). Every part of the plan is worded by the plan's one renderer
(``elixir_runtime/plan_view.py``, through the planner's face); this module adds what only the
command line knows (the model's name, where the hardware and host memory come from, timings).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from elixir_runtime.config import ElixirConfig, PlanError
from elixir_runtime.hardware import HardwareProfile
from elixir_runtime.plan_view import (
    activations_text,
    alternatives_table,
    budget_text,
    candidates_table,
    host_line,
    memory_lines,
    moments_hint,
    offload_text,
    plan_table,
    profile_text,
    size_text,
    step_text,
    tflops,
)
from elixir_runtime.planner import (
    Budget,
    ElixirPlan,
    ModelProfile,
    PlanJob,
    Target,
    find_units,
    plan_model,
    profile_job,
)

from ...loss import use_lean_loss
from ...patches import mask_decisions_of
from ...presets import PRESETS, canonical_name, close_presets
from .hardware import host_hardware, host_memory
from .lora import Lora, lora_model, lora_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["PlanReport", "plan_report", "model_config", "build_meta_model"]

GIB = 2**30
HOST_PINNED_WARN = 0.9
"""Share of the host's RAM a plan may pin before ``elixir-plan`` warns: the rest is all the job's other
memory (data loader workers, page cache, a checkpoint save) and everything else on the host has."""
LORA_HINT = (
    "\nOr a LoRA fine-tune instead of a full one (--lora plans it): its base frozen, 2 bytes per parameter "
    "in bf16 and no gradients or Adam state, only the adapters trained"
)
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
    """The ``--json`` document (``model``, ``settings``, ``profile``, ``hardware``, ``plan``, ``timings``,
    ``warnings``)."""
    warnings: list[str]
    """What the user should act on before running the plan (said on stderr, and in ``doc``)."""


Profiles = dict[tuple[object, ...], ModelProfile]
"""Profiled steps by what they depend on (``_step_key``): kept across the plans of one process."""


def plan_report(
    args: argparse.Namespace,
    config: ElixirConfig,
    hardware: HardwareProfile,
    hw_note: str = "",
    profiles: Profiles | None = None,
) -> PlanReport:
    """The plan for ``args`` (the parsed command line) and ``config`` (what it asks of the engine) on
    ``hardware``; ``hw_note``: where the hardware profile comes from when it is not this machine's;
    ``profiles``: the steps already profiled in this process, taken where this plan's is one of them and
    added to otherwise (plans of one model for many boxes: ``benchmarks.doc_numbers``)."""
    card = args.gpu_mem or hardware.gpu_memory
    _check_cap(args, hardware, card)
    host_bytes, host_source = host_memory(args, hardware)
    hardware = host_hardware(args, hardware)  # its CPU Adam rates for the host's cores
    t0 = time.perf_counter()
    with quiet_transformers():  # its warnings about use_cache, token ids, ... say nothing about the plan
        hf_config = model_config(args.model, args.seq_len)
        try:
            model = build_meta_model(hf_config, args.dtype, args.ac)
        except (ValueError, RuntimeError) as exc:  # sizes the model refuses: heads not dividing, a negative size
            raise ValueError(f"--model {args.model}: its config builds no model: {exc}") from None
        _check_batch(args, cast("PreTrainedModel", model), card if args.gpu_memory is None else args.gpu_memory)
        lora = lora_of(args)
        if lora is not None:
            model = lora_model(model, lora)
        if args.lean_loss:  # as build_engine does
            use_lean_loss(model)
        build_s = time.perf_counter() - t0
        trained = "" if lora is None else _lora_text(lora, model)
        ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
        batch = {"input_ids": ids, "labels": ids}
        job = PlanJob(model, find_units(model, config.unit_classes), batch, config, torch.device("cuda"), args.dtype)
        target = _target(args, hardware, card, host_bytes)

        t1 = time.perf_counter()
        key = _step_key(args, hf_config, config, lora)
        profile = None if profiles is None else profiles.get(key)
        if profile is None:
            with mask_decisions_of(batch):
                profile = profile_job(job, exact=args.exact)  # one step's: the same for every config planned below
            if profiles is not None:
                profiles[key] = profile
        t2 = time.perf_counter()

        def plan_for(cfg: ElixirConfig) -> ElixirPlan:
            with mask_decisions_of(batch):
                return plan_model(replace(job, config=cfg), target, profile=profile).plan

        try:
            plan = plan_for(config)
        except PlanError as exc:
            host = (
                ""
                if isinstance(args.host_mem, int)
                else f"\n(host memory: {size_text(host_bytes)}, {host_source}; --host-mem to plan for another host)"
            )
            raise PlanError(f"{exc}{host}{'' if lora else LORA_HINT}") from exc
        assert plan.profile is not None and plan.budget is not None, "plan_model's plan is searched"
        timings = {"build_s": build_s, "profile_s": t2 - t1, "search_s": time.perf_counter() - t2}
        accumulated = _accumulated(args, config, plan, plan_for)
    title = _title(args, card, plan.budget)
    text = _text(args, plan, hardware, hw_note, card, host_source, accumulated, trained)
    details = _details(plan, hardware, hw_note, timings)
    doc = _doc(args, plan, hardware, hw_note, host_source, timings)
    if lora is not None:
        doc["lora"] = {"rank": lora.rank, "targets": lora.targets, "trainable": _trainable(model)}
    if accumulated is not None:
        doc["accumulated"] = {
            "grad_accum": 2,
            "predicted_step_s": accumulated.predicted_step_s,
            "tflops": tflops(accumulated, 2),
        }
    warnings = host_warnings(plan)
    doc["warnings"] = warnings
    return PlanReport(plan, title, text, details, doc, warnings)


def _step_key(
    args: argparse.Namespace, hf_config: PretrainedConfig, config: ElixirConfig, lora: Lora | None
) -> tuple[object, ...]:
    """What a profiled step depends on: the model, its batch and dtype, checkpointing, LoRA, the loss, the
    units, the tracing; not the card, the host or the number of GPUs."""
    shape = (args.batch_size, args.seq_len, str(args.dtype), args.ac, repr(lora), args.lean_loss)
    return (hf_config.to_json_string(), *shape, args.exact, repr(config.unit_classes))


def _trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _lora_text(lora: Lora, model: torch.nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = _trainable(model)
    return (
        f"{lora.text()}: {trainable / 1e6:.1f} M parameters trained ({trainable / total:.2%}), the base's "
        f"{(total - trainable) / 1e9:.3f} B frozen (its weights only: no gradients, no Adam state)"
    )


def host_warnings(plan: ElixirPlan) -> list[str]:
    """A plan pinning more than ``HOST_PINNED_WARN`` of the host's RAM, in numbers and with the fix."""
    assert plan.budget is not None, "a searched plan"
    pinned, host = plan.host_bytes * plan.budget.ranks_per_host, plan.budget.host_capacity
    if not host or pinned <= HOST_PINNED_WARN * host:
        return []
    return [
        f"the plan pins {size_text(pinned)} of the host's {size_text(host)} RAM ({pinned / host:.0%}): "
        f"{size_text(host - pinned)} is left for everything else (data loader workers, the page cache, a checkpoint "
        "save, other processes), and the job may be killed for memory. To leave room: plan with a smaller --host-mem "
        "and run that plan (--json's plan as the run's --elixir FILE), or use more GPUs"
    ]


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


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level inside (its own verbosity switch), restored after."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _check_cap(args: argparse.Namespace, hardware: HardwareProfile, card: int) -> None:
    named = -(-hardware.gpu_memory // GIB) * GIB  # the card's size rounded up to whole GiB, as sizes are said
    if args.gpu is not None and args.gpu_mem is not None and args.gpu_mem > named:
        raise ValueError(
            f"--gpu-mem {args.gpu_mem / GIB:.2f} GiB is more than the {hardware.gpu_memory / GIB:.2f} GiB of "
            f"--gpu {args.gpu}: drop --gpu-mem to plan for that card, give at most {named // GIB} GiB, or name a "
            "larger card"
        )
    cap = args.gpu_memory
    if cap is not None and cap > card:
        raise ValueError(
            f"--gpu-memory {cap / GIB:.2f} GiB is more than the {card / GIB:.2f} GiB of the GPU planned for "
            f"({'--gpu-mem' if args.gpu_mem else hardware.device}): give at most {card} bytes, or plan for a larger "
            "card (--gpu NAME, --gpu-mem, or --hardware with its profile)"
        )


def _check_batch(args: argparse.Namespace, model: PreTrainedModel, gpu: int) -> None:
    """Before the profile: a ``--seq-len`` beyond the positions a model learns (GPT-2's, OPT's: an
    embedding row a position) fails its run's first forward; a batch whose hidden states alone (one layer's
    output, on the GPU in any plan) exceed the GPU's ``gpu`` bytes fits no plan, and its profile's loss loop
    would run for hours. ``ValueError`` naming the flags, the values and the fix."""
    positions = getattr(model.config, "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    learned = positions is not None and any(
        isinstance(m, torch.nn.Embedding) and m is not inputs and m.num_embeddings in (positions, positions + 2)
        for m in model.modules()  # GPT-2's wpe; OPT's embed_positions, 2 rows of offset
    )
    if learned and args.seq_len > positions:
        raise ValueError(
            f"--seq-len {args.seq_len} is more than the {positions} positions --model {args.model} learns (its "
            f"config's max_position_embeddings): a run's first forward fails indexing them; give --seq-len "
            f"{positions} or less, or a config with more positions"
        )
    tokens = args.batch_size * args.seq_len
    hidden = tokens * inputs.embedding_dim * args.dtype.itemsize
    if hidden > gpu:
        raise ValueError(
            f"--batch-size {args.batch_size} x --seq-len {args.seq_len}: {tokens} tokens per GPU, whose hidden states "
            f"alone (one layer's output, {inputs.embedding_dim} values a token) take {size_text(hidden)}, more than "
            f"the GPU's {size_text(gpu)}: lower --batch-size or --seq-len (--grad-accum N keeps the tokens per step)"
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

    return Target(args.gpus, hardware, budget)


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
    trained: str = "",
) -> str:
    """The default output: what was planned for (``trained``: a LoRA's adapters), memory per GPU and host,
    what is offloaded, the step (and, where it is host-bound, the step of two micro-batches)."""
    return "\n\n".join(
        [
            _header(args, plan, hardware, hw_note, card, host_source) + (f"\n{trained}" if trained else ""),
            "\n".join(
                [*memory_lines(plan), host_line(plan), "held activations: " + activations_text(plan)]
                + ["offloaded: " + offload_text(plan)]
            ),
            step_text(plan, args.grad_accum)
            + ("\n" + _accumulated_text(plan, accumulated) if accumulated else "")
            + "".join(
                f"\n  moments {o.moments}: {moments_hint(o, plan.predicted_step_s)}"
                for o in (plan.search.moments if plan.search else ())
            ),
        ]
    )


def _accumulated_text(plan: ElixirPlan, accumulated: ElixirPlan) -> str:
    t, t2 = plan.predicted, accumulated.predicted
    assert t is not None and t2 is not None, "searched plans"
    return (
        f"  host-bound: {t.exposed_cpu_adam:.3f} s of it is the CPU update of offloaded chunks, once per optimizer "
        f"step whatever its tokens; with 2 micro-batches per step (--grad-accum 2; the Trainer's "
        f"gradient_accumulation_steps) the plan predicts {t2.total:.3f} s for twice the tokens, "
        f"{tflops(accumulated, 2):.0f} TFLOPS per GPU"
    )


def _header(
    args: argparse.Namespace, plan: ElixirPlan, hardware: HardwareProfile, hw_note: str, card: int, host_source: str
) -> str:
    gpus = f"{args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    accum = f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    assert plan.budget is not None and plan.profile is not None, "a searched plan"
    assert plan.batch_shape is not None, "a plan made with an example batch"
    cap = plan.budget.limit
    memory = size_text(card) if cap is None else f"{size_text(cap)} of its {size_text(card)} (--gpu-memory)"
    gpu_source = hw_note or f"this machine's GPU ({hardware.source})"
    return "\n".join(
        [
            f"{args.model}: {plan.profile.parameters / 1e9:.3f} B parameters, batch {args.batch_size} x {args.seq_len} "
            f"tokens per GPU{accum}, {gpus}, {plan.dtype}, activation checkpointing {'on' if args.ac else 'off'}",
            f"planned batch shape: {list(plan.batch_shape)} (batch_shape in the plan; a run's larger batch runs if the budget holds it, else is refused)",
            f"GPU:  {hardware.device}, {memory}; {gpu_source}",
            f"host: {size_text(plan.budget.host_capacity)} RAM, {host_source}",
        ]
    )


# --------------------------------------------------------------------------- --verbose


def _details(plan: ElixirPlan, hardware: HardwareProfile, hw_note: str, timings: dict[str, float]) -> str:
    assert plan.search is not None and plan.profile is not None and plan.budget is not None, "a searched plan"
    notes = "".join(f"\nnote: {n}" for n in plan.search.notes)
    return "\n\n".join(
        [
            "== profile ==\n" + profile_text(plan.profile),
            f"== hardware ==\n{hardware.device}: {hardware.source}" + (f"\n{hw_note}" if hw_note else ""),
            "== plan ==\n" + plan_table(plan, verbose=True),
            "== memory budget per GPU ==\n" + budget_text(plan.budget),
            "== alternatives (same chunks) ==\n" + alternatives_table(plan),
            "== chunk sizes tried ==\n" + candidates_table(plan),
            f"model built in {timings['build_s']:.2f} s, profiled in {timings['profile_s']:.2f} s, searched "
            f"{len(plan.search.candidates)} chunk sizes in {timings['search_s']:.2f} s" + notes,
        ]
    )


def _doc(
    args: argparse.Namespace,
    plan: ElixirPlan,
    hardware: HardwareProfile,
    hw_note: str,
    host_source: str,
    timings: dict[str, float],
) -> dict[str, Any]:
    assert plan.profile is not None and plan.budget is not None, "a searched plan"
    return {
        "model": args.model,
        "settings": {
            k: str(v).removeprefix("torch.") if k == "dtype" else v
            for k, v in vars(args).items()
            if k not in ("json", "plot", "measure_hardware", "verbose")
        },
        "profile": plan.profile.to_dict(),
        "hardware": {"device": hardware.device, "source": hardware.source, "note": hw_note},
        "host": {"memory": plan.budget.host_capacity, "source": host_source},
        "plan": plan.to_dict(),
        "timings": timings,
    }


def model_config(name: str, seq_len: int) -> PretrainedConfig:
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
        try:
            data = json.loads(path.read_text())
            return AutoConfig.for_model(data.pop("model_type"), **data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, no model_type, not an object
            raise ValueError(
                f"--model {name}: not a model's config.json ({type(exc).__name__}: {exc}): a JSON object with the "
                "model's model_type and sizes, as a Hub model's config.json"
            ) from None
    presets = f"the presets: {', '.join(PRESETS)}"
    try:  # the cache first: no network for a model already here
        cached: PretrainedConfig = AutoConfig.from_pretrained(name, local_files_only=True)
        return cached
    except (OSError, ValueError) as exc:
        if "/" not in name and not path.is_dir():  # no Hub id (owner/name): a preset mistyped, not a network call
            close = close_presets(name)
            meant = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(
                f"--model {name}: no preset, config.json or folder of that name ({meant}{presets}); a Hub model is "
                f"owner/name, e.g. meta-llama/Llama-3.1-8B"
            ) from exc
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--model {name}: not a preset, a config.json, or a Hub id that can be loaded here ({type(exc).__name__}: "
            f"{exc}); without network, download its config.json and pass its path ({presets})"
        ) from exc
    return config


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype, checkpointing: bool) -> torch.nn.Module:
    """On the meta device, with sdpa attention (what a GPU run uses) where the model supports it,
    else the model's own implementation."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            # a copy: a refused attempt leaves its choice in the config
            model: PreTrainedModel = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa"
            )
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
