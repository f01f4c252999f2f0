"""The search: chunk size, rCache size and placement that minimise the serial step time.

For every candidate chunk size the parameters are laid out exactly as the engine will
(``build_layout``), the profiled unit events become a chunk trace, Belady is simulated for every
rCache size at once, and the I(n)/J(n) placement picks blocks and GPU-resident chunks within the
budget. The candidate with the shortest serial step wins (the device's transfers overlapped as
predicted, the host's transfers and updates back to back: ``step_time.py`` says why not the
overlapped step); serial steps within ``SERIAL_TIE`` of the shortest tie, and the fastest
predicted (overlapped) step among them wins; within ``STEP_TIE`` of it the smallest chunk size,
then the one moving fewest bytes through the rCache (the paper's criterion). If no candidate
fits, ``PlanError`` says by how much and what would make it fit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..chunk.layout import ChunkLayout, build_layout, round_up
from ..config import ElixirConfig, PlanError
from ..hardware.profile import HardwareProfile, Rates
from ..host import GIB
from ..host import size_text as gib
from ..profiler.profile import ModelProfile
from ..progress import track
from ..units import ParamTable
from .access import AccessTrace, access_trace, unit_work
from .belady import MissTable
from .budget import Budget
from .candidates import chunk_size_candidates
from .memory import ArenaBytes, GradWindow, grad_window
from .placement import Placement, best_placement, offloaded_chunks
from .report import Alternative, Candidate, RateSummary, SearchReport
from .step_time import StepModel

__all__ = ["Layouts", "SearchSettings", "SearchResult", "search", "resident_chunks", "table_layout"]


SERIAL_TIE = 0.01
"""Chunk sizes whose serial steps are within 1 % of the shortest tie; the overlapped step decides
(the serial step is blind to prefetching: docs/planning.md, "The search")."""

STEP_TIE = 0.005
"""Among those, predicted steps within 0.5 % of the fastest tie, and the smallest chunk size wins
(the step model does not see how coarse the pipeline is: docs/planning.md, "Memory of a plan")."""


@dataclass(frozen=True)
class SearchSettings:
    world_size: int
    dtype: torch.dtype
    config: ElixirConfig = field(default_factory=ElixirConfig)
    """The user's choices: ``chunk_size``, ``n_blocks`` and ``offload`` when given are honoured (the
    rest is searched); ``alignment``, ``prefetch``, ``clips_grads`` and ``grad_accum_steps`` as the
    engine will run."""
    busbw: float | None = None
    """Collective bus bandwidth measured on the job's process group (``measure.collective_busbw``)."""
    device_lane: bool = False
    """The GPU helps update offloaded chunks (``ElixirConfig.device_assisted_update`` resolved for the
    device: ``planner.device_lane_wanted``): its staging memory and its rate enter the plan."""
    grads_share_activations: bool = True
    """The allocator lets the GPU's gradient shards reuse the memory the loss's activations free
    (expandable segments, ``gpu_limit.expandable_segments``); otherwise all of them are counted."""

    @property
    def micro_batches(self) -> int:
        return self.config.grad_accum_steps

    @property
    def clips_grads(self) -> bool:
        """The training loop syncs the host before ``step()``: the CPU updates start after backward;
        otherwise during it (``step_time.StepModel``). fp16's overflow check and the non-finite skip
        (``ElixirConfig.skip_nonfinite``) read the gradient norm: a host sync, as clipping is."""
        return self.config.clips_grads or self.config.skip_nonfinite or self.dtype == torch.float16


@dataclass(frozen=True)
class SearchResult:
    """The search's choice and why. The plan's own numbers (chunk count, rCache bounds, memory) are
    the plan's to count (``plan.resolve_plan``), from ``layout``."""

    chunk_size: int
    layout: ChunkLayout | None = field(repr=False, compare=False)
    """The winning layout, built from the table the search was given: this process's parameters,
    so ``None`` in a copy sent to other ranks (they build it from ``chunk_size``)."""
    placement: Placement
    """rCache blocks, offloaded chunks, predicted step time and bytes, I(n)/J(n) of the winner."""
    budget: Budget
    report: SearchReport
    """I(n)/J(n) at the choice, every chunk size tried, notes, seconds, the rates and hardware priced with."""
    alternatives: tuple[Alternative, ...] = ()
    regions: tuple[tuple[str, ...], ...] = ()
    """Parameter names of each activation-checkpointed region of the profile: their chunks must be
    resident together (``ChunkLayout.block_bounds``), in the search and in the plan."""
    device_lane: bool = False
    """Whether the placement was searched with the device update lane (``SearchSettings.device_lane``)."""
    grad_window: GradWindow = field(default_factory=GradWindow)
    """What the GPU's gradient shards share memory with (``memory.grad_window``): the plan counts its
    memory with the same."""

    def noted(self, *notes: str, first: bool = False) -> SearchResult:
        """This result with ``notes`` added to its report's, after them (or before, ``first``)."""
        old = self.report.notes
        return replace(self, report=replace(self.report, notes=(*notes, *old) if first else (*old, *notes)))


@dataclass
class _Evaluated:
    layout: ChunkLayout
    model: StepModel
    mem: ArenaBytes
    min_blocks: int
    max_blocks: int
    placement: Placement | None
    blocks: int
    """The fewest rCache blocks this layout was searched with: ``ElixirConfig.n_blocks`` where set, else ``min_blocks``."""


def search(
    table: ParamTable,
    profile: ModelProfile,
    hardware: HardwareProfile,
    budget: Budget,
    settings: SearchSettings,
    *,
    layouts: Layouts | None = None,
) -> SearchResult:
    """``layouts``: the layouts of ``table`` for ``profile`` already built by another search of them (a plan's
    searches share them: ``Layouts``)."""
    start = time.perf_counter()
    rates = hardware.rates(settings.world_size, settings.busbw, budget.ranks_per_host, settings.config.state)
    layouts = layouts or Layouts(table, profile)
    assert layouts.table is table and layouts.profile is profile, "layouts of this table and profile"
    sizes = [settings.config.chunk_size] if settings.config.chunk_size is not None else layouts.sizes(settings)
    backward = profile.backward if settings.grads_share_activations else []
    window = grad_window(budget.activations, backward, budget.f_alloc, budget.f_frag, settings.micro_batches)
    evaluated = [
        _evaluate(c, table, profile, rates, budget, settings, window, layouts)
        for c in track(sizes, "elixir: searching chunk sizes", unit="size")
    ]
    fitting = [(e, e.placement) for e in evaluated if e.placement is not None]
    if not fitting and settings.device_lane and settings.config.device_assisted_update == "auto":
        # the lane's staging buffers may be what does not fit: without it, the CPU alone
        result = search(table, profile, hardware, budget, replace(settings, device_lane=False), layouts=layouts)
        return result.noted("device update lane off: with its staging buffers no plan fits the GPU")
    if not fitting:
        fewest = min(e.min_blocks for e in evaluated)
        if isinstance(settings.config.n_blocks, int) and settings.config.n_blocks < fewest:
            raise PlanError(
                f"rCache of {settings.config.n_blocks} blocks is smaller than the largest unit or checkpointed region, whose "
                f"parameters span at least {fewest} chunks that must be resident together: use n_blocks >= {fewest}, "
                "or a larger chunk_size"
            )
        raise PlanError(_no_fit_message(evaluated, profile, budget, settings))
    shortest = min(p.time.serial for _, p in fitting)
    near = [(e, p) for e, p in fitting if p.time.serial <= shortest * (1 + SERIAL_TIE)]
    fastest = min(p.time.total for _, p in near)
    best, p = min(
        ((e, p) for e, p in near if p.time.total <= fastest * (1 + STEP_TIE)),
        key=lambda ep: (ep[0].layout.chunk_size, ep[1].time.total, ep[1].time.rcache_bytes),
    )
    if settings.device_lane and settings.config.device_assisted_update == "auto":
        # The lane takes link bandwidth the CPU update needs (its rate under copies, not alone)
        # and staging memory: it is kept only where the predicted step says it pays.
        alone = search(table, profile, hardware, budget, replace(settings, device_lane=False), layouts=layouts)
        if alone.placement.time.total <= p.time.total:
            return alone.noted(
                f"device update lane off: predicted step {alone.placement.time.total:.3f} s without it, "
                f"{p.time.total:.3f} s with it"
            )
    report = SearchReport(
        i_per_gib=_per_gib(p.i_per_byte),
        j_per_gib=_per_gib(p.j_per_byte),
        candidates=tuple(_candidate(e) for e in evaluated),
        notes=(*rates.notes, *_update_note(p.offload, settings.clips_grads)),
        seconds=time.perf_counter() - start,
        rates=RateSummary.of(rates, best.model.cpu_rate),
        hardware=HardwareProfile.from_dict(hardware.to_dict()),  # a copy: the plan's, whatever loads after
    )
    return SearchResult(
        chunk_size=best.layout.chunk_size,
        layout=best.layout,
        placement=p,
        budget=budget,
        report=report,
        alternatives=_alternatives(best, budget),
        regions=tuple(tuple(r.params) for r in profile.ac_regions),
        device_lane=settings.device_lane,
        grad_window=window,
    )


def _per_gib(per_byte: float) -> float | None:
    return per_byte * GIB if math.isfinite(per_byte) else None


def resident_chunks(
    layout: ChunkLayout, table: ParamTable, regions: Sequence[Sequence[str]]
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], tuple[int, ...]]:
    """The chunks of every unit (``table.units`` order) and of every checkpointed region (its
    parameter names): each set must be resident at once (``ChunkLayout.block_bounds``); and the
    root's, of the parameters read outside their units (``ParamTable.resident``), resident from
    the root's pre-forward on."""
    units = [layout.chunks_of(table.index[id(p)] for p in u.params) for u in table.units]
    held = [layout.chunks_of(table.by_name[n] for n in names if n in table.by_name) for names in regions]
    return units, held, layout.chunks_of([i for i, r in enumerate(table.resident) if r])


def table_layout(table: ParamTable, world_size: int, chunk_size: int | None, alignment: int) -> ChunkLayout:
    """``table``'s parameters in chunks as the engine lays them out (``build_layout``)."""
    return build_layout(
        table.params,
        table.names,
        table.groups,
        table.private,
        world_size=world_size,
        chunk_size=chunk_size,
        alignment=alignment,
    )


@dataclass(frozen=True)
class _Shaped:
    """A layout of the table and what of it depends on nothing but the profiled step."""

    layout: ChunkLayout
    min_blocks: int
    max_blocks: int
    root: tuple[int, ...]
    """The chunks the root's pre-forward acquires (``resident_chunks``)."""
    trace: AccessTrace
    misses: MissTable


class Layouts:
    """The layouts of one table, with their rCache bounds, access traces and Belady misses, for one profiled
    step, by world size, alignment and chunk size: built once and shared by every search of them (a plan's
    activation tiers, moments, with and without the update lane), which differ in what they price only."""

    def __init__(self, table: ParamTable, profile: ModelProfile) -> None:
        self.table, self.profile = table, profile
        self._work = {u.name: float(unit_work(u.module, u.params)) for u in table.units}
        """Parameter elements each unit computes with (``access.unit_work``)."""
        self._shaped: dict[tuple[int, int, int], _Shaped] = {}

    def sizes(self, settings: SearchSettings) -> list[int]:
        """The candidate chunk sizes (``chunk_size_candidates``) for ``settings``' world size and alignment."""
        table, alignment = self.table, settings.config.layout_alignment
        unit_numels = [sum(round_up(p.numel(), alignment) for p in u.params) for u in table.units]
        params = [p.numel() for p in table.params]
        return chunk_size_candidates(
            params, table.private, unit_numels, world_size=settings.world_size, alignment=alignment
        )

    def of(self, chunk_size: int, settings: SearchSettings) -> _Shaped:
        """The layout of ``chunk_size`` for ``settings``' world size and alignment, built on first use."""
        key = (chunk_size, settings.world_size, settings.config.layout_alignment)
        if key not in self._shaped:
            self._shaped[key] = self._shape(*key)
        return self._shaped[key]

    def _shape(self, chunk_size: int, world_size: int, alignment: int) -> _Shaped:
        table, profile = self.table, self.profile
        layout = table_layout(table, world_size, chunk_size, alignment)
        units, regions, root = resident_chunks(layout, table, [r.params for r in profile.ac_regions])
        lo, hi = layout.block_bounds([*units, *regions])
        private = {c.index for c in layout.chunks if c.private}
        unit_chunks = {u.name: cs for u, cs in zip(table.units, units)}
        trace = access_trace(profile.unit_events, unit_chunks, private, self._work)
        return _Shaped(layout, lo, hi, root, trace, MissTable(trace.groups, trace.phases, len(layout.chunks)))


def _evaluate(
    chunk_size: int,
    table: ParamTable,
    profile: ModelProfile,
    rates: Rates,
    budget: Budget,
    settings: SearchSettings,
    window: GradWindow | None = None,
    layouts: Layouts | None = None,
) -> _Evaluated:
    shaped = (layouts or Layouts(table, profile)).of(chunk_size, settings)
    layout, lo, hi = shaped.layout, shaped.min_blocks, shaped.max_blocks
    model = StepModel(
        layout,
        shaped.trace,
        profile.compute,
        rates,
        settings.dtype,
        min_blocks=lo,
        root=shaped.root,
        prefetch=settings.config.prefetch,
        micro_batches=settings.micro_batches,
        clips_grads=settings.clips_grads,
        device_lane=settings.device_lane,
        state=settings.config.state,
        misses=shaped.misses,
    )
    mem = ArenaBytes(
        layout,
        settings.dtype,
        settings.config.state,
        settings.device_lane,
        window if window is not None else GradWindow(),
    )
    n_blocks = {"min": lo, "max": hi}.get(settings.config.n_blocks, settings.config.n_blocks)  # type: ignore[arg-type]
    if isinstance(n_blocks, int):
        n_blocks = min(n_blocks, hi)
        if n_blocks < lo:
            return _Evaluated(layout, model, mem, lo, hi, None, n_blocks)
    offload = (
        None
        if settings.config.offload is None
        else offloaded_chunks(settings.config.offload, len(layout.chunks), chunk_size)
    )
    placement = best_placement(model, mem, budget, lo, hi, n_blocks=n_blocks, offload=offload)
    return _Evaluated(layout, model, mem, lo, hi, placement, n_blocks if isinstance(n_blocks, int) else lo)


def _update_note(offload: Sequence[int], clips_grads: bool) -> list[str]:
    if not offload:
        return []
    if clips_grads:
        return [
            "CPU Adam of offloaded chunks predicted to start after backward (the loop clips gradients or "
            "checks for non-finite steps or trains in fp16: one host sync before the update)"
        ]
    return [
        "CPU Adam of offloaded chunks predicted to start during backward, as their gradients land "
        "(no host sync before the update: clips_grads=False, skip_nonfinite=False)"
    ]


def _candidate(e: _Evaluated) -> Candidate:
    p = e.placement
    return Candidate(
        chunk_size=e.layout.chunk_size,
        n_chunks=len(e.layout.chunks),
        min_blocks=e.min_blocks,
        n_blocks=p.n_blocks if p else None,
        offloaded=len(p.offload) if p else None,
        rcache_gib_per_step=p.time.rcache_bytes / GIB if p else None,
        step_s=float(p.time.total) if p else None,
        serial_s=float(p.time.serial) if p else None,
    )


def _alternatives(best: _Evaluated, budget: Budget) -> tuple[Alternative, ...]:
    """The rigid end points of the same layout: ZeRO-2/3-like with everything offloaded, and the
    rCache extremes with nothing offloaded."""
    k = len(best.layout.chunks)
    none, every = np.zeros(k, dtype=bool), np.ones(k, dtype=bool)
    out = []
    for name, blocks, on_device in (
        ("zero2-offload-all", best.max_blocks, none),
        ("zero3-offload-all", best.min_blocks, none),
        ("rcache-max", best.max_blocks, every),
        ("rcache-min", best.min_blocks, every),
    ):
        device, host = best.mem.device(blocks, on_device), best.mem.host(on_device)
        out.append(
            Alternative(
                name=name,
                n_blocks=blocks,
                offloaded=int((~on_device).sum()),
                device_bytes=device,
                host_bytes=host,
                fits=device <= budget.allowed and host <= budget.host_allowed,
                time=best.model.step(blocks, on_device),
            )
        )
    return tuple(out)


def _no_fit_message(
    evaluated: list[_Evaluated], profile: ModelProfile, budget: Budget, settings: SearchSettings
) -> str:
    pinned = _pinned_offload_message(evaluated, budget, settings)
    if pinned:
        return pinned
    act, allowed, n = budget.activations, budget.allowed, settings.world_size
    formula = (
        f"U_allowed = {budget.f_alloc} x ({gib(budget.capacity)} GPU - {gib(budget.buffers)} buffers - "
        f"{budget.f_frag} x {gib(act)} activations) = {gib(allowed)} per rank"
    )
    # the smallest plan of each layout: the rCache it was held to, and as few chunks on the GPU as the host allows
    needs = []
    for e in (e for e in evaluated if e.blocks >= e.min_blocks):  # n_blocks below a layout's minimum rules it out
        on_device = np.zeros(len(e.layout.chunks), dtype=bool)
        for c in range(len(on_device)):
            if e.mem.host(on_device) <= budget.host_allowed:
                break
            on_device[c] = True
        needs.append((e.mem.device(e.blocks, on_device), e.mem.host(np.zeros_like(on_device)), e))
    device_need, host_all, e = min(needs, key=lambda x: x[0])
    host_bound = host_all > budget.host_allowed  # the host cannot take every chunk
    fixed = e.blocks * e.mem.buffer + e.mem.private  # rCache and private blocks: do not shrink with N
    chosen = e.blocks > e.min_blocks  # ElixirConfig.n_blocks holds the rCache above its minimum
    states = int(e.mem.host_arena.sum()) * n  # every rank's arenas together, offloaded
    if allowed <= 0:  # the batch alone fills the GPU: no formula with a negative result
        lines = [
            f"no plan fits: this batch's activations ({gib(act)}, {budget.f_frag} x for fragmentation) and "
            f"buffers ({gib(budget.buffers)}) take more than the GPU's {gib(budget.capacity)} per rank, before any "
            "model state."
        ]
    else:
        lines = [
            f"no plan fits: the smallest one (chunks of {e.layout.chunk_size:,} elements, rCache of {e.blocks} "
            f"blocks{' (ElixirConfig.n_blocks)' if chosen else ''}, as much offloaded as the host takes) needs "
            f"{gib(device_need)} of GPU memory per rank for model states and rCache, but {formula}."
        ]
    if budget.limit is not None:
        lines.append(
            f"The GPU capacity is capped at {gib(budget.limit)} per process (ElixirConfig.gpu_memory or "
            "torch.cuda.set_per_process_memory_fraction): a larger cap is the first fix if the GPU has room."
        )
    if host_bound:
        lines.append(
            f"The model states take {gib(states)} in all ({n} rank(s)); the host has {budget.host_accounting()}."
        )
    fixes = [f"a smaller rCache: n_blocks >= {e.min_blocks}, or unset for the search's choice"] if chosen else []
    headroom = (budget.capacity - budget.buffers - device_need / budget.f_alloc) / budget.f_frag
    if act > 0 and 0 < headroom < act:
        fixes.append(
            f"a smaller batch or sequence: activations must drop from {gib(act)} to below {gib(headroom)} "
            f"(about {headroom / act:.0%} of this batch)"
        )
    if not profile.ac_regions:
        fixes.append("activation checkpointing (model.gradient_checkpointing_enable())")
    room = allowed - fixed
    host_total = budget.f_host * budget.host_capacity * n / budget.ranks_per_host
    if room > 0:
        gpus = -(-(states - host_total) // room) if states > host_total else n + 1
        fixes.append(
            f"at least {max(int(gpus), n + 1)} GPUs on this host (each rank holds 1/N of every chunk's states)"
        )
    else:
        fixes.append(f"GPUs with more memory: the rCache and the private blocks alone need {gib(fixed)} per rank")
    if host_bound or room > 0:
        fixes.append(_host_fix(gib((states - max(room, 0) * n) / budget.f_host), n))
    return "\n".join(lines) + "\nTo make it fit: " + "; or ".join(fixes) + "."


def _pinned_offload_message(evaluated: list[_Evaluated], budget: Budget, settings: SearchSettings) -> str | None:
    """The no-fit message where ``ElixirConfig.offload`` names the chunks to offload and the host
    cannot take them (in the layout needing the least); ``None`` where the host is not the limit."""
    if settings.config.offload is None:
        return None
    needs = []
    for e in evaluated:
        offload = offloaded_chunks(settings.config.offload, len(e.layout.chunks), e.layout.chunk_size)
        on_device = np.ones(len(e.layout.chunks), dtype=bool)
        on_device[offload] = False
        needs.append((e.mem.host(on_device), len(offload), len(on_device)))
    host, k, n_chunks = min(needs)
    if host <= budget.host_allowed:
        return None
    return (
        f"no plan fits: ElixirConfig.offload={settings.config.offload!r} puts {k} of {n_chunks} chunks in host memory, "
        f"{gib(host)} per rank, but the host has {budget.host_accounting()}.\nTo make it fit: offload fewer chunks "
        f"(ElixirConfig.offload); or "
        + _host_fix(gib(host * budget.ranks_per_host / budget.f_host), budget.ranks_per_host)
        + "."
    )


def _host_fix(need: str, ranks: int) -> str:
    return (
        f"host RAM of at least {need} for these {ranks} rank(s) (available to the job before its model is loaded: "
        "what elixir-plan --host-mem means)"
    )
