"""The planner: the one place a plan is decided, for ``prepare``, ``elixir-plan`` and the benchmarks.

Each entry returns a ``Planned``: the frozen ``ElixirPlan`` (the file's contents, built once) and
the live layout it was decided on (``LivePlan``: table, layout, each unit's chunks), so nothing
downstream builds them again. Each takes a ``PlanJob``: what a plan is decided from (the model, its
units and example batch, the config, device, dtype, the job's ranks, param groups, the parameters
read outside their modules, a plan to follow). ``plan_model`` decides it for a ``Target`` (world
size, hardware profile, memory budget): profile the step → unit order → parameter table → search →
the plan of the winning layout, which the search built. ``plan_static`` is a plan *given* (a static
config or a plan file: its chunk size): the layout is built from it, nothing is searched.
``plan_job`` is ``prepare``'s entry: searched (``search_job``: the job's hardware measured, decided
on rank 0, the plan given to every rank) or static; a plan file to follow checked against the
layout this model gives (``PlanMismatch``), then the plan against this machine's memory, the
host's as the run will have it (``job_host_memory``). Runs before any training memory exists.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .adam_state import Moments
from .config import ElixirConfig, PlanError, PlanMismatch, Where
from .distributed.collectives import Collectives
from .gpu_limit import device_capacity, process_limit
from .hardware.load import job_hardware, own_profile, with_step_gemms
from .hardware.measure import collective_busbw
from .hardware.profile import HardwareProfile
from .host import HostMemory, held_bytes, host_available, local_ranks
from .plan import DEVICE_MEMORY, ElixirPlan, LivePlan, Planned, check_fits, resolve_plan
from .plan_view import moments_hint, size_text
from .profiler.kernels import cuda_attention
from .profiler.outside import parameters_named
from .profiler.profile import ModelProfile, ProfileSummary, profile_model, structural_profile
from .profiler.trace import trace_unit_order
from .progress import progress
from .runtime.batch_guard import token_shape
from .search.budget import F_FRAG, Budget
from .search.loop import Layouts, SearchResult, SearchSettings, search, table_layout
from .search.report import ActivationsOption, Alternative, Candidate, MomentsOption, SearchReport
from .search.step_time import StepTime, with_held_copies
from .units import ParamTable, Unit, find_units, param_table

__all__ = [
    "PlanJob",
    "Target",
    "plan_model",
    "profile_job",
    # what plan_model takes and returns, as elixir-plan reads them (the renderers: plan_view.py)
    "find_units",
    "ModelProfile",
    "Budget",
    "StepTime",
    "ElixirPlan",
    "LivePlan",
    "Planned",
    "ProfileSummary",
    "SearchReport",
    "Candidate",
    "Alternative",
    "DEVICE_MEMORY",
    "plan_static",
    "plan_job",
    "search_job",
    "device_budget",
    "job_host_memory",
    "device_lane_wanted",
    "UNPROFILED_ACTIVATION_SHARE",
]

logger = logging.getLogger(__name__)

UNPROFILED_ACTIVATION_SHARE = 0.4
"""Without an example batch the activations are unknown: this share of the GPU is kept for them."""

ParamGroup = Callable[[nn.Parameter], int]
"""The optimizer param group of a trainable parameter (``prepare``'s optimizer); ``None``: group 0."""

Resident = Collection[nn.Parameter]
"""Parameters read outside their module's call (``prepare``'s ``resident``; ``units.param_table``)."""


@dataclass(frozen=True)
class PlanJob:
    """What a plan is decided from: the model and its step, the config, where and how it runs. Every
    entry of the planner takes one; ``dataclasses.replace`` gives the same job under another config."""

    model: nn.Module
    units: list[Unit]
    """Its fetch units (``units.find_units``)."""
    example_batch: object | None
    """A batch of the run's shape (profiled on fake tensors); ``None``: planned without a profile."""
    config: ElixirConfig
    device: torch.device
    dtype: torch.dtype
    coll: Collectives = field(default_factory=lambda: Collectives(None))
    """The job's ranks (default: one process, or the default group where one is up)."""
    param_group: ParamGroup | None = None
    resident: Resident = ()
    grads_share_activations: bool = True
    """``SearchSettings.grads_share_activations``: the allocator's expandable segments are on."""
    follow: ElixirPlan | None = None
    """The plan a plan file gives, whose layout this model's must be (``plan_job``: ``PlanMismatch``)."""

    @property
    def batch_shape(self) -> tuple[int, int] | None:
        """The shape of the batch the plan is made with (``ElixirPlan.batch_shape``)."""
        return token_shape(self.example_batch) if self.example_batch is not None else None


@dataclass(frozen=True)
class Target:
    """The machine a searched plan is decided for (the job's device and dtype: ``PlanJob``)."""

    world_size: int
    hardware: HardwareProfile
    budget: Callable[[ModelProfile], Budget]
    """The memory budget for a profiled step (``device_budget`` on the job's GPU)."""
    busbw: float | None = None
    """Collective bus bandwidth measured on the job's process group (``measure.collective_busbw``)."""
    times_gemms: bool = False
    """The job runs on its device with this machine's own profile: the search prices the step's GEMM
    shapes at rates timed there (``hardware.load.with_step_gemms``)."""


def device_lane_wanted(config: ElixirConfig, device: torch.device) -> bool:
    """Whether the search may plan the device lane on ``device``: ``True``; ``"auto"`` on a GPU (where
    the search keeps it only if its predicted step is shorter, ``search/loop.py``); ``False`` never."""
    if config.device_assisted_update == "auto":
        return device.type == "cuda"
    return bool(config.device_assisted_update)


def device_budget(device: torch.device, activations: int, buffers: int, host: HostMemory) -> Budget:
    """The budget of a live CUDA device: what is free now plus what torch's allocator holds unused,
    within the process's limit; the host's memory as the run will have it (``job_host_memory``)."""
    return Budget(
        capacity=device_capacity(device),
        activations=activations,
        buffers=buffers,
        host_capacity=host.capacity,
        ranks_per_host=host.ranks,
        limit=process_limit(device),
        host_released=host.released,
    )


def job_host_memory(
    model: nn.Module, example_batch: object | None, device: torch.device, coll: Collectives
) -> HostMemory:
    """This host's memory as the run will have it ([Note: host memory as the run will have it],
    ``host.py``): ``MemAvailable`` now plus what every rank on this host frees when ``prepare``
    takes its weights into chunks (its parameters; its buffers, moved to ``device``; the example
    batch, which ``prepare`` keeps no reference to). A collective where the job has several ranks."""
    released = held_bytes(_released_tensors(model, example_batch, device))
    if coll.world_size > 1:
        here = socket.gethostname()
        released = sum(held for host, held in coll.everyones((here, released), device) if host == here)
    return HostMemory(host_available(), released, local_ranks())


def _released_tensors(model: nn.Module, batch: object, device: torch.device) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    if device.type != "cpu":
        yield from model.buffers()
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def plan_model(job: PlanJob, target: Target, *, exact: bool = False, profile: ModelProfile | None = None) -> Planned:
    """The searched plan of ``job`` for ``target``; ``exact``: trace every block (``profile_model``);
    ``profile``: ``profile_job(job)``'s, taken once where one job is planned several times (other configs,
    other targets). Not checked against this machine's memory (``check_fits``)."""
    return _searched(job, target, profile or profile_job(job, exact=exact)).planned(job, target.world_size)


def profile_job(job: PlanJob, *, exact: bool = False) -> ModelProfile:
    """A training step of ``job.model`` on ``job.example_batch``, profiled as the plan's search needs it."""
    with progress(1, "elixir: profiling a training step") as bar:
        profile = _profile(job.model, job.units, job.example_batch, job.dtype, job.device, exact)
        bar.update()
    return profile


def plan_static(job: PlanJob, order: list[int], outside: list[str] | None = None) -> Planned:
    """The plan of ``job.config`` as given (its chunk size, else the default; rCache max and nothing
    offloaded unless it says otherwise) for units called in ``order``; ``outside``: the parameters
    the traced forward read outside their units, beside ``job.resident``."""
    config = job.config
    table = _table(job, order, _with_outside(job.model, job.resident, outside or []))
    layout = table_layout(table, job.coll.world_size, config.chunk_size, config.layout_alignment)
    lane = device_lane_wanted(config, job.device)
    return resolve_plan(config, table, layout, job.dtype, lane=lane, batch_shape=job.batch_shape)


def plan_job(job: PlanJob) -> Planned:
    """``prepare``'s plan, the same on every rank and checked against this machine's memory:
    searched with ``mode="auto"`` on a GPU (``search_job``), else as the config gives it
    (``plan_static``) in the use order traced on rank 0. ``job.follow``: the plan a plan file gives,
    whose layout this model's must be (``PlanMismatch``)."""
    host = job_host_memory(job.model, job.example_batch, job.device, job.coll)
    if job.config.mode == "auto" and job.device.type == "cuda":
        planned = search_job(job, host=host)
    else:
        order, outside = job.coll.decided_by_rank0(
            lambda: trace_unit_order(job.model, job.units, job.example_batch, job.dtype, job.device), job.device
        )
        planned = plan_static(job, order, outside)
    if job.follow is not None:
        _check_follows(job.follow, planned)
    check_fits(planned.plan, job.device, host)
    return planned


def _check_follows(given: ElixirPlan, planned: Planned) -> None:
    """A plan to follow must describe the layout this model gives: its chunks, their size, the ranks."""
    got = {k: getattr(planned.plan, k) for k in ("n_chunks", "chunk_size", "world_size")}
    want = {k: getattr(given, k) for k in got}
    if got == want:
        return
    table = planned.live.param_table
    outside = [table.names[i][0] for i, r in enumerate(table.resident) if r]
    raise PlanMismatch(
        f"the plan file does not fit this model: it describes {want}, this model gives {got}; re-plan for this "
        "model (--elixir auto), or load the model the plan was made for"
        + (
            f". Here {outside} have chunks of their own because the forward reads them outside their module "
            "(a fused LM head or loss), which elixir-plan cannot know: use --elixir auto or a JSON config instead "
            "of the plan file"
            if outside
            else ""
        )
    )


def search_job(job: PlanJob, *, host: HostMemory | None = None) -> Planned:
    """The searched plan of the job ``coll`` spans, on ``device``'s free memory and ``host``'s
    (default: ``job_host_memory``), identical on every rank.

    [Note: one decision, every rank]
    Every rank first times the engine's collectives on the job's own process group (the bandwidth
    the plan's gathers and reductions will get) and gets the job's hardware profile
    (``hardware.load.job_hardware``: rank 0 loads or measures it; a per-rank CPU Adam rate this
    machine's profile lacks, all ranks measure at once). Then rank 0 decides, as free memory differs
    a little from GPU to GPU, and sends the use order and the search's result. The layout the
    search built holds rank 0's parameters, so it is not sent: the other ranks build theirs from
    the chosen chunk size, as from any plan given.
    """
    coll, device, dtype = job.coll, job.device, job.dtype
    host = host or job_host_memory(job.model, job.example_batch, device, coll)
    busbw = collective_busbw(coll, device, dtype) if coll.world_size > 1 else None
    hardware = job_hardware(coll, device, job.config.cpu_threads, state=job.config.state)

    def budget(profile: ModelProfile) -> Budget:
        return device_budget(device, profile.activation_peak, profile.buffer_bytes, host)

    target = Target(coll.world_size, hardware, budget, busbw, own_profile())
    mine: list[_Searched] = []

    def decide() -> tuple[list[int], list[str], SearchResult, ProfileSummary, Where]:
        mine.append(_searched(job, target, profile_job(job)))
        s = mine[0]
        return s.order, s.outside, replace(s.result, layout=None), s.profile, s.activations

    order, outside, result, profile, activations = coll.decided_by_rank0(decide, device)
    if not mine:
        table = _table(job, order, _with_outside(job.model, job.resident, outside, log=False))
        mine.append(_Searched(order, outside, table, result, profile, activations))
    return mine[0].planned(job, coll.world_size)


@dataclass(frozen=True)
class _Searched:
    """The search's decision with what it was made from."""

    order: list[int]
    """Unit indices in first-use order."""
    outside: list[str]
    """Parameters the profiled forward read outside their units (``ModelProfile.read_outside``)."""
    table: ParamTable
    result: SearchResult
    profile: ProfileSummary
    activations: Where = "device"
    """Where the search put the held block inputs (``_search_activations``)."""

    def planned(self, job: PlanJob, world_size: int) -> Planned:
        """The plan of the winning layout (built here from the chosen chunk size where the result came
        from another rank)."""
        layout = self.result.layout or table_layout(
            self.table, world_size, self.result.chunk_size, job.config.layout_alignment
        )
        return resolve_plan(
            job.config,
            self.table,
            layout,
            job.dtype,
            search=self.result,
            batch_shape=job.batch_shape,
            profile=self.profile,
            activations=self.activations,
        )


def _searched(job: PlanJob, target: Target, profile: ModelProfile) -> _Searched:
    """Profile → unit order → table → budget → search."""
    device, dtype, config = job.device, job.dtype, job.config
    hardware = target.hardware
    if target.times_gemms:
        hardware = with_step_gemms(hardware, profile.flop_classes, dtype, device)
    order = profile.unit_indices(job.units)
    table = _table(job, order, _with_outside(job.model, job.resident, profile.read_outside))
    budget = target.budget(profile)
    if job.example_batch is None:
        budget = replace(budget, activations=int(UNPROFILED_ACTIVATION_SHARE * budget.capacity / F_FRAG))
    settings = SearchSettings(
        target.world_size,
        dtype,
        config,
        busbw=target.busbw,
        device_lane=device_lane_wanted(config, device),
        grads_share_activations=job.grads_share_activations,
    )
    shapes = sum(1 for c in profile.flop_classes if c in hardware.gemms)
    layouts = Layouts(table, profile)  # built once for every search below
    result, activations = _search_activations(layouts, hardware, budget, settings, device)
    result = result.noted(
        f"hardware: {hardware.device}, {hardware.source}",
        f"profile: {profile.seconds:.2f} s; activation peak at {profile.peak_at}",
        *([f"GEMMs: {shapes} shapes of this step at their rates timed on this GPU"] if shapes else []),
        first=True,
    )
    return _Searched(order, profile.read_outside, table, result, profile.summary(), activations)


def _search_activations(
    layouts: Layouts, hardware: HardwareProfile, budget: Budget, settings: SearchSettings, device: torch.device
) -> tuple[SearchResult, Where]:
    """The search with the held block inputs where the config puts them, or, with ``"auto"`` on a GPU, in each
    tier: the shorter predicted step wins, the device on a tie; the other is on the report.

    [Note: activations as a plan choice]
    Under activation checkpointing the held block inputs are most of what a long sequence keeps on the GPU
    (``runtime/held_inputs.py``). On the host they free ``ModelProfile.activation_peak -
    host_activation_peak`` of the GPU for chunks (fewer offloaded, a larger rCache) and take
    ``held_inputs`` of pinned host memory from the arenas (``Budget.host_activations``); their copies
    out in the forward and back in the backward share the host link with the chunks' transfers, beside
    compute (``search.step_time.with_held_copies``). The planner weighs both tiers as it weighs chunk placements: by the
    predicted step, never by a rule of thumb on the sequence length."""
    asked, held = settings.config.activations, layouts.profile.held_inputs
    if asked == "host" and not held:
        raise PlanError(
            "activations 'host': the profiled step holds no block inputs for a recompute (activation checkpointing "
            "is off): enable it (--gradient_checkpointing, model.gradient_checkpointing_enable()), or set activations "
            "'auto' or 'device'"
        )
    tiers: list[Where] = (
        [asked] if asked != "auto" else ["device", "host"] if held and device.type == "cuda" else ["device"]
    )
    found: dict[Where, SearchResult] = {}
    failed: dict[Where, PlanError] = {}
    for where in tiers:
        try:
            found[where] = _search_in(where, layouts, hardware, budget, settings)
        except PlanError as err:
            failed[where] = err
    if not found:
        if len(tiers) == 1:
            raise failed[tiers[0]]
        raise PlanError(
            f"{failed['device']}\nWith the held block inputs in pinned host memory ({size_text(held)}) neither: "
            f"{failed['host']}"
        )
    chosen = min(found, key=lambda w: (found[w].placement.time.total, w != "device"))
    result = found[chosen]
    for other in (w for w in tiers if w != chosen):
        alt = found.get(other)
        option = ActivationsOption(
            other,
            held,
            None if alt is None else len(alt.placement.offload),
            None if alt is None or alt.layout is None else len(alt.layout.chunks),
            None if alt is None else float(alt.placement.time.total),
        )
        result = replace(result, report=replace(result.report, activations=(option,)))
    return result, chosen


def _search_in(
    where: Where, layouts: Layouts, hardware: HardwareProfile, budget: Budget, settings: SearchSettings
) -> SearchResult:
    """The search with the held block inputs in ``where`` ([Note: activations as a plan choice])."""
    if where == "device":
        return _search_with_moments(layouts, hardware, budget, settings)
    profile = layouts.profile
    held = profile.held_inputs
    if held > budget.host_allowed:
        raise PlanError(
            f"activations 'host': the held block inputs need {size_text(held)} of pinned host memory per rank, but "
            f"the host has {budget.host_accounting()}: keep them on the GPU (activations 'device'), train a shorter "
            "sequence or a smaller batch, or use a host with more memory"
        )
    on_host = replace(budget, activations=profile.host_activation_peak, host_activations=held)
    result = _search_with_moments(layouts, hardware, on_host, settings)
    rates = hardware.rates(settings.world_size, settings.busbw, budget.ranks_per_host, settings.config.state)
    return replace(
        result, placement=replace(result.placement, time=with_held_copies(result.placement.time, held, rates))
    )


COMPACT: Moments = "8bit"
"""The moments an exact plan that offloads, or does not fit, is searched with beside it."""


def _search_with_moments(
    layouts: Layouts, hardware: HardwareProfile, budget: Budget, settings: SearchSettings
) -> SearchResult:
    """``search``; where the config keeps exact moments and the plan offloads (host-bound updates) or
    does not fit, the same job searched with 8-bit moments too, shown on the report (``MomentsOption``)
    or in the error: what switching would buy, never switched to."""
    if settings.config.moments == COMPACT:
        return _search(layouts, hardware, budget, settings)
    compact = replace(settings, config=replace(settings.config, moments=COMPACT))
    try:
        result = _search(layouts, hardware, budget, settings)
    except PlanError as err:
        other = _searched_or_none(layouts, hardware, budget, compact)
        if other is None:
            raise
        raise PlanError(f"{err}\n{moments_hint(_option(other), None)}") from None
    if not result.placement.offload:
        return result
    other = _searched_or_none(layouts, hardware, budget, compact)
    if other is None:
        return result
    return replace(result, report=replace(result.report, moments=(_option(other),)))


def _search(layouts: Layouts, hardware: HardwareProfile, budget: Budget, settings: SearchSettings) -> SearchResult:
    return search(layouts.table, layouts.profile, hardware, budget, settings, layouts=layouts)


def _searched_or_none(
    layouts: Layouts, hardware: HardwareProfile, budget: Budget, settings: SearchSettings
) -> SearchResult | None:
    try:
        return _search(layouts, hardware, budget, settings)
    except PlanError:
        return None


def _option(result: SearchResult) -> MomentsOption:
    p = result.placement
    assert result.layout is not None, "a search in this process keeps its layout"
    n = len(result.layout.chunks)
    return MomentsOption(COMPACT, len(p.offload), n, p.device_bytes, p.host_bytes, float(p.time.total))


def _table(job: PlanJob, order: list[int], resident: Resident) -> ParamTable:
    """The parameter table of ``job.model`` for units called in ``order``, ``resident`` (``job.resident`` and
    what the forward read outside its units: ``_with_outside``) given chunks of their own."""
    table = param_table(job.model, job.units, order, resident)
    if job.param_group is None:
        return table
    return replace(table, groups=[job.param_group(p) if p.requires_grad else -1 for p in table.params])


def _with_outside(model: nn.Module, resident: Resident, outside: list[str], log: bool = True) -> list[nn.Parameter]:
    """``resident`` and the parameters the traced forward read outside their units (``outside``: names)."""
    given = {id(p) for p in resident}
    found = [p for p in parameters_named(model, outside) if id(p) not in given]
    if found and log:
        logger.info(
            "elixir: the forward reads %s outside their modules' calls: they get chunks of their own that every "
            "forward gathers first",
            ", ".join(outside),
        )
    return [*resident, *found]


def _profile(
    model: nn.Module,
    units: list[Unit],
    batch: object | None,
    dtype: torch.dtype,
    device: torch.device,
    exact: bool = False,
) -> ModelProfile:
    """The step's profile on fake tensors of ``device``, else of the CPU (CUDA attention kept), else
    the structural one (no batch, or model code that cannot run on fake tensors)."""
    if batch is None:
        logger.warning(
            "elixir auto plan without an example batch: activations are unknown, so %.0f%% of the GPU is kept for "
            "them; pass example_batch to prepare() for a plan from a profiled step",
            100 * UNPROFILED_ACTIVATION_SHARE,
        )
        return structural_profile(model, units, dtype)
    try:
        return profile_model(model, batch, dtype=dtype, device=device, units=units, exact=exact)
    except Exception as exc:
        logger.info(
            "elixir: profile on fake %s tensors failed (%s: %s); retrying on fake CPU ones",
            device,
            type(exc).__name__,
            exc,
        )
    try:
        with cuda_attention():
            return profile_model(model, batch, dtype=dtype, device="cpu", units=units, exact=exact)
    except Exception as exc:  # model code that cannot run on fake tensors (data-dependent control flow)
        logger.warning("elixir: the fake-tensor profile failed (%s: %s); planning without it", type(exc).__name__, exc)
        return _profile(model, units, None, dtype, device)
