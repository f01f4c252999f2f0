"""The one renderer of an ``ElixirPlan``: every figure a reader sees of a plan, worded here once.

Three readers, one source each: the table a run logs when it builds the engine (``plan_table``;
``elixir-plan --verbose`` prints it too), ``elixir-plan``'s text (``memory_lines``, ``host_line``,
``offload_text``, ``step_text`` and the ``--verbose`` sections) and the run's ``elixir/plan_*``
metrics (``plan_metrics``). Each reads the frozen plan alone (its search report, profile summary
and chunks included), so a plan read from a file renders as the plan a run decided.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .host import GIB, size_text
from .plan import ElixirPlan
from .profiler.profile import ProfileSummary
from .runtime.device_lane import LANE_DEPTH
from .search.budget import Budget
from .search.report import MomentsOption
from .search.step_time import StepTime

__all__ = [
    "MEMORY_PARTS",
    "alternatives_table",
    "activations_text",
    "moments_hint",
    "budget_text",
    "candidates_table",
    "chunk_layers",
    "describe_layers",
    "format_step_time",
    "host_line",
    "memory_lines",
    "offload_text",
    "plan_metrics",
    "plan_table",
    "profile_text",
    "size_text",
    "step_text",
    "tflops",
]

MEMORY_PARTS = {
    "rcache": "gathered-parameter cache (rCache)",
    "private": "tied / oversize weights, kept gathered",
    "device_shards": "model states on the GPU (weights, Adam state)",
    "device_grads": "their gradients, beyond what the activations free",
    "lane_staging": "update-lane staging",
}
"""What each of the plan's ``DEVICE_MEMORY`` parts holds, in a user's words."""


# --------------------------------------------------------------------------- the run's table


def plan_table(plan: ElixirPlan, verbose: bool = False) -> str:
    """The plan in rows of plain words (logged by the HF integration when it builds the engine);
    ``verbose`` adds the search's I(n)/J(n) at the choice (``elixir-plan --verbose``)."""
    memory = plan.memory
    own = "; tied or oversize parameters get chunks of their own" if memory.private else ""
    rows = [
        ("chunks", f"{plan.n_chunks} of at most {plan.chunk_size:,} elements ({plan.dtype}){own}"),
        (
            "gathered-parameter cache",
            f"{plan.n_blocks} blocks (rCache; at least {plan.min_blocks}, at most {plan.max_blocks} useful)",
        ),
    ]
    if memory.private:
        rows.append(
            (
                "own-chunk buffers",
                f"{_gib(memory.private)} GiB (tied parameters and those larger than a chunk, or read outside their "
                "module: kept gathered)",
            )
        )
    rows += [("offloaded chunks", f"{len(plan.offload)} of {plan.n_chunks}"), ("world size", str(plan.world_size))]
    if plan.batch_shape:
        b, s = plan.batch_shape
        beyond = "runs if the budget holds it, else is refused" if plan.budget and plan.profile else "warns"
        rows.append(("planned batch", f"{b} x {s} tokens per micro-batch (a larger training batch {beyond})"))
    rows += [
        ("GPU memory / rank", f"{_gib(plan.device_bytes)} GiB (model states + gathered-parameter cache)"),
        ("host memory / rank", f"{_gib(plan.host_bytes)} GiB (pinned)"),
        ("held activations", activations_text(plan)),
        ("device update lane", _lane_text(plan)),
    ]
    if memory.activations is not None:
        rows.append(
            (
                "GPU peak / rank",
                f"{_gib(plan.device_peak_bytes)} GiB (+ activations {_gib(memory.activations)}, buffers "
                f"{_gib(memory.buffers or 0)})",
            )
        )
    if plan.gpu_memory is not None:
        rows.append(("GPU memory cap", f"{_gib(plan.gpu_memory)} GiB per GPU (ElixirConfig.gpu_memory)"))
    if plan.budget is not None:
        rows.append(
            (
                "budget / rank",
                f"{_gib(plan.budget.allowed)} GiB GPU for model states and cache, {_gib(plan.budget.host_allowed)} "
                "GiB pinned host",
            )
        )
    if plan.predicted is not None:
        rows.append(("predicted step", format_step_time(plan.predicted)))
    rates = plan.search.rates if plan.search is not None else None
    if rates is not None:
        cpu = f" ({rates.cpu_adam_alone_Gps} alone)" if rates.cpu_adam_alone_Gps else ""
        if rates.cpu_update_observed_Gps:
            cpu += f" ({rates.cpu_update_observed_Gps} in a run here)"
        rows.append(
            (
                "rates / rank",
                f"H2D {rates.h2d_GBps} / D2H {rates.d2h_GBps} GB/s, collectives {rates.busbw_GBps or '-'} GB/s, "
                f"Adam GPU {rates.gpu_adam_Gps} / CPU {rates.cpu_adam_Gps}{cpu} G params/s"
                + (f" ({rates.cpu_threads} threads)" if rates.cpu_threads else ""),
            )
        )
    for option in plan.search.moments if plan.search is not None else ():
        rows.append((f"moments {option.moments}", moments_hint(option, plan.predicted_step_s)))
    if verbose and plan.search is not None:
        i, j = ("-" if v is None else f"{v * 1e3:.2f}" for v in (plan.search.i_per_gib, plan.search.j_per_gib))
        rows.append(
            ("I(n) / J(n)", f"{i} / {j} ms per GiB saved by one more rCache block / by the next upload (- : none left)")
        )
    return _rows(rows)


def activations_text(plan: ElixirPlan) -> str:
    """Where the plan keeps the held block inputs, and what the other tier would give where the planner chose:
    ``host: 12.00 GiB pinned, ...; on the GPU: 3 of 40 chunks offloaded, predicted 1.234 s (0.91x)``."""
    held = plan.profile.held_inputs if plan.profile is not None else None
    size = f" ({_gib(held)} GiB)" if held else ""
    text = (
        f"host: the held block inputs{size} in pinned host memory, out in the forward and back ahead of each recompute"
        if plan.activations == "host"
        else f"device: the held block inputs{size} stay on the GPU"
    )
    for option in plan.search.activations if plan.search is not None else ():
        tier = "on the host" if option.where == "host" else "on the GPU"
        if option.step_s is None:
            text += f"; {tier}: no plan fits"
            continue
        off = (
            "nothing offloaded" if not option.offloaded else f"{option.offloaded} of {option.n_chunks} chunks offloaded"
        )
        step = plan.predicted_step_s
        speed = f" ({step / option.step_s:.2f}x this plan's step)" if step else ""
        text += f"; {tier}: {off}, predicted {option.step_s:.3f} s a step{speed}"
    return text


def moments_hint(option: MomentsOption, step_s: float | None) -> str:
    """What a plan with ``option``'s moments would be, against a plan's ``step_s`` (``None``: none fits):
    ``moments 8bit: nothing offloaded, predicted 1.71 s (1.33x), ...``."""
    off = "nothing offloaded" if not option.offloaded else f"{option.offloaded} of {option.n_chunks} chunks offloaded"
    speed = f" ({step_s / option.step_s:.2f}x this plan's step)" if step_s else ""
    return (
        f"{off}, {_gib(option.device_bytes)} GiB GPU, {_gib(option.host_bytes)} GiB host, predicted "
        f"{option.step_s:.3f} s a step{speed}: fp32 master weights with block-wise 8-bit Adam moments, "
        f"""not exact AdamW (--elixir '{{"moments": "{option.moments}"}}', docs/planning.md)"""
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.3f}"


def _lane_text(plan: ElixirPlan) -> str:
    if plan.device_lane:
        return f"on: {LANE_DEPTH} x {plan.device_lane:,} elements staged ({_gib(plan.memory.lane_staging)} GiB)"
    return "off (CPU alone)" if plan.offload else "- (nothing offloaded)"


def _rows(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_step_time(t: StepTime) -> str:
    """``1.234 s (compute 1.0, exposed transfers 0.1, GPU Adam 0.1, exposed CPU Adam 0.0; moved: ...)``."""
    coll = "not measured" if t.collectives is None else f"{t.collectives:.3f}"
    return (
        f"{t.total:.3f} s (compute {t.compute:.3f}, exposed transfers {t.exposed_transfers:.3f}, "
        f"GPU Adam {t.gpu_adam:.3f}, exposed CPU Adam {t.exposed_cpu_adam:.3f}; moved: H2D {t.h2d:.3f}, "
        f"D2H {t.d2h:.3f}, collectives {coll}, CPU Adam {t.cpu_adam:.3f}"
        + (f", device lane Adam {t.device_lane_adam:.3f}" if t.device_lane_adam else "")
        + ")"
    )


# --------------------------------------------------------------------------- the run's metrics


def plan_metrics(plan: ElixirPlan) -> dict[str, float]:
    """The plan's key numbers (``elixir_hf``'s ``elixir/plan_*`` log values, without the prefix): its
    shape and pinned host memory; a searched plan adds its predicted step and GPU update and, offloading,
    the CPU update, the forward's wait for it and the CPU update rate it priced; a profiled plan (its
    activations known) its GPU peak."""
    out = {
        "plan_chunks": plan.n_chunks,
        "plan_chunk_size": plan.chunk_size,
        "plan_rcache_blocks": plan.n_blocks,
        "plan_offloaded_chunks": len(plan.offload),
        "plan_device_gib": plan.device_bytes / GIB,
        "plan_host_gib": plan.host_bytes / GIB,
        "plan_activations_on_host": float(plan.activations == "host"),
    }
    if (t := plan.predicted) is not None:
        out["plan_step_s"] = t.total
        out["plan_optimizer_s"] = t.gpu_adam
        if plan.offload:
            out["plan_cpu_update_s"] = t.cpu_adam
            out["plan_update_wait_s"] = t.exposed_cpu_adam
            rates = plan.search.rates if plan.search is not None else None
            if rates is not None and rates.cpu_update_Gps:
                out["plan_cpu_update_Gps"] = rates.cpu_update_Gps
    if plan.memory.activations is not None:
        out["plan_gpu_peak_gib"] = plan.device_peak_bytes / GIB
    return out


# --------------------------------------------------------------------------- elixir-plan's text


def memory_lines(plan: ElixirPlan) -> list[str]:
    """One GPU's memory by part, in words; the optional parts only where the plan has them."""
    memory, profile = plan.memory, plan.profile
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
        ("activations (peak)", memory.activations or 0, f"at {profile.peak_at}" if profile else "", True),
        ("buffers", memory.buffers or 0, "the model's buffers", False),
    ]
    rows = [row for row in rows if row[1] or row[3]]
    width = max(len(name) for name, *_ in rows) + 2
    head = f"GPU memory per GPU: {size_text(plan.device_peak_bytes)}"
    if plan.budget is not None:
        head += f" of {size_text(plan.budget.capacity)}"
    return [head] + [f"  {name:<{width}}{size_text(n):>10}  {what}" for name, n, what, _ in rows]


def host_line(plan: ElixirPlan) -> str:
    """The pinned host memory per GPU (and for every GPU of the host), of what the budget allows."""
    pinned = plan.host_bytes
    if plan.budget is None:
        return f"host memory: {size_text(pinned)} pinned per GPU" if pinned else "host memory: nothing pinned"
    ranks = plan.budget.ranks_per_host
    usable = size_text((plan.budget.host_allowed + plan.budget.host_activations) * ranks)
    if not pinned:
        return f"host memory: nothing pinned ({usable} usable for offloaded chunks)"
    both = f", {size_text(pinned * ranks)} for the {ranks} GPUs" if ranks > 1 else ""
    held = plan.memory.host_activations
    parts = f" ({size_text(plan.memory.host_shards)} chunks, {size_text(held)} held block inputs)" if held else ""
    return f"host memory: {size_text(pinned)} pinned per GPU{parts}{both}, of {usable} usable"


def offload_text(plan: ElixirPlan) -> str:
    """Which chunks live in host memory, which layers they hold, and why."""
    if not plan.offload:
        return f"nothing: all {plan.n_chunks} chunks keep weights, gradients and Adam state on the GPU"
    layers = describe_layers(n for i in plan.offload if plan.chunks for n in plan.chunks[i].params)
    text = (
        f"{len(plan.offload)} of {plan.n_chunks} chunks" + (f" ({layers})" if layers else "") + " keep their weights "
        "and Adam state in pinned host memory; the CPU updates them while the GPU computes"
    )
    on_gpu = [a for a in plan.alternatives if a.name in ("rcache-min", "rcache-max") and not a.offloaded]
    smallest = min(on_gpu, key=lambda a: a.device_bytes, default=None)
    if smallest is not None and not smallest.fits and plan.budget is not None:
        text += (
            f"\n  why: keeping every chunk on the GPU needs {size_text(smallest.device_bytes)} per GPU for "
            f"model states and cache, more than the {size_text(plan.budget.allowed)} the GPU has for them "
            "beside the activations"
        )
    return text


def tflops(plan: ElixirPlan, micro_batches: int = 1) -> float:
    """8 x parameters x tokens per optimizer step / the predicted step (per GPU): what
    ``benchmarks/`` reports; the tokens are ``micro_batches`` of the planned batch."""
    assert plan.profile is not None and plan.predicted is not None, "a searched plan"
    assert plan.batch_shape is not None, "a plan made with an example batch"
    b, s = plan.batch_shape
    return 8 * plan.profile.parameters * b * s * micro_batches / plan.predicted.total / 1e12


def step_text(plan: ElixirPlan, micro_batches: int = 1) -> str:
    """The predicted step by part, its TFLOPS, and the rigid offload-all plans beside it."""
    t = plan.predicted
    assert t is not None, "a searched plan"
    rate = tflops(plan, micro_batches)
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
    rigid = {a.name: a for a in plan.alternatives}
    zero = [
        f"{label} {rigid[k].time.total:.3f} s"
        for k, label in (
            ("zero2-offload-all", "ZeRO-2-like offload-all"),
            ("zero3-offload-all", "ZeRO-3-like offload-all"),
        )
        if k in rigid
    ]
    return "\n".join(
        [
            f"predicted step: {t.total:.3f} s per optimizer step ({', '.join(parts)})",
            f"  {rate:.{0 if rate >= 100 else 1 if rate >= 1 else 3}f} TFLOPS per GPU (8 x parameters x tokens / step time)"
            + (f"; for comparison {', '.join(zero)}" if zero else ""),
        ]
    )


# --------------------------------------------------------------------------- elixir-plan --verbose


def profile_text(p: ProfileSummary) -> str:
    """The profiled step in rows: sizes, the activation peak and where, checkpointing, compute, tracing."""
    late = (
        f", after the head {p.late_peak / GIB:.2f} GiB falling to {p.late_low / GIB:.2f} GiB"
        if p.late_peak is not None and p.late_low is not None  # both of the same segments, or neither
        else ""
    )
    blocks = (
        f"{p.blocks.profiled} of {p.blocks.total} identical blocks ({p.blocks.prefix}) traced, the rest "
        "replayed; embeddings, head and loss traced exactly"
        if p.blocks
        else "every block traced"
    )
    return _rows(
        [
            (
                "model",
                f"{p.model}: {p.parameters / 1e9:.3f} B parameters, {p.parameter_bytes / GIB:.2f} GiB in {p.dtype}",
            ),
            ("batch", " ".join(dict.fromkeys("x".join(map(str, s)) for s in p.inputs))),  # ids and labels: once
            (
                "activation peak",
                f"{p.activation_peak / GIB:.2f} GiB (at {p.peak_at}); forward peak {p.forward_peak / GIB:.2f} GiB, "
                f"saved for backward {p.saved_bytes / GIB:.2f} GiB{late}",
            ),
            (
                "checkpointing",
                f"{p.ac_regions} regions, largest {p.ac_buffer_numel / 1e6:.1f} M elements" if p.ac_regions else "off",
            ),
            ("tied parameters", str(len(p.tied))),
            ("buffers", f"{p.buffer_bytes / 2**20:.1f} MiB"),
            (
                "compute",
                f"forward {p.forward_flops / 1e12:.2f} TFLOP, backward {p.backward_flops / 1e12:.2f} TFLOP "
                "(incl. recomputation)",
            ),
            ("traced", f"{blocks}, in {p.seconds:.2f} s on {p.device}"),
        ]
    )


def budget_text(budget: Budget) -> str:
    """The memory budget's formula with its terms (``search/budget.py``)."""
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


def alternatives_table(plan: ElixirPlan) -> str:
    """The chosen plan beside the rigid ones of its layout: memory, whether each fits, its step."""
    assert plan.predicted is not None, "a searched plan"
    rows = [
        ("elixir (chosen)", plan.n_blocks, len(plan.offload), plan.device_bytes, plan.host_bytes, True, plan.predicted)
    ]
    rows += [(a.name, a.n_blocks, a.offloaded, a.device_bytes, a.host_bytes, a.fits, a.time) for a in plan.alternatives]
    head = f"{'plan':<18} {'blocks':>6} {'offloaded':>9} {'GPU GiB':>8} {'host GiB':>8} {'fits':>5} {'step s':>8}  breakdown"
    lines = [head]
    for name, blocks, off, dev, host, fits, t in rows:
        lines.append(
            f"{name:<18} {blocks:>6} {off:>9} {dev / GIB:>8.2f} {host / GIB:>8.2f} {'yes' if fits else 'NO':>5} "
            f"{t.total:>8.3f}  {format_step_time(t)}"
        )
    return "\n".join(lines)


def candidates_table(plan: ElixirPlan) -> str:
    """Every chunk size the search tried, the chosen one marked."""
    assert plan.search is not None, "a searched plan"
    head = f"{'chunk size':>12} {'chunks':>6} {'min blocks':>10} {'blocks':>6} {'offloaded':>9} {'step s':>8}"
    lines = [head]
    for c in plan.search.candidates:
        lines.append(
            f"{c.chunk_size:>12,} {c.n_chunks:>6} {c.min_blocks:>10} "
            + (f"{c.n_blocks:>6} {c.offloaded:>9} {c.step_s:>8.3f}" if c.fits else f"{'-':>6} {'-':>9} {'no fit':>8}")
            + ("  <- chosen" if c.chunk_size == plan.chunk_size else "")
        )
    return "\n".join(lines)


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
    return ", ".join(f"{part}.{_ranges(sorted(set(blocks[part])))}" if part in blocks else part for part in parts)


def _ranges(indices: list[int]) -> str:
    runs: list[str] = []
    start: int | None = indices[0]  # None past the last index
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def chunk_layers(plan: ElixirPlan) -> list[str]:
    """What each chunk holds, in short (``describe_layers``); empty names for a plan built without
    its chunks (``ElixirPlan.chunks``)."""
    if not plan.chunks:
        return [""] * plan.n_chunks
    return [describe_layers(c.params) for c in plan.chunks]
