"""``prepare``: turns a model and the user's Adam/AdamW into a chunked, sharded, offloadable pair.

Order matters and is the whole point of the function: every check and the plan happen before
any training memory is allocated; then the shards are filled from the live weights, the
parameters become views into the rCache (placeholders of the right shape when not gathered),
and the hooks are installed on the same ``nn.Module`` object the user keeps calling.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .adam_state import adam_state
from .chunk.host_memory import unpin_host
from .config import ElixirConfig
from .distributed.collectives import Collectives
from .distributed.lockstep import Lockstep
from .gpu_limit import expandable_segments, limit_gpu_memory
from .hardware.load import record_update_rate
from .host import local_ranks
from .kernels.threads import cpu_adam_threads
from .optim.optimizer import ElixirOptimizer
from .plan import ElixirPlan, LivePlan
from .plan_view import plan_table
from .planner import PlanJob, plan_job
from .runtime.chunk_runtime import ChunkRuntime
from .runtime.context import EngineContext
from .runtime.device_lane import DeviceLane
from .runtime.held_inputs import HeldInputs
from .runtime.hooks import EngineHooks, install_hooks
from .runtime.oom import PlannedMemory
from .runtime.update_rate import UpdateRateProbe
from .state_dict import ModelStateHooks
from .units import Unit, find_units
from .weights.attached import detach_weights
from .weights.source import WeightSource, unmeta_parameters, weight_source

__all__ = ["prepare", "release", "ElixirState"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ElixirState:
    """What ``prepare`` attached to the model (``model._elixir``), for introspection and teardown."""

    runtime: ChunkRuntime
    plan: ElixirPlan
    live: LivePlan
    """The parameter table, layout and unit chunks the plan was decided on (not in the plan file)."""
    units: list[Unit]
    optimizer: ElixirOptimizer
    model_state: ModelStateHooks
    """The consolidated ``state_dict``/``load_state_dict`` hooks (``checkpoint.rank0_state_dict`` sets them)."""
    hooks: EngineHooks
    """The module and gradient hooks (``runtime/hooks.py``); the units' are off while parked (``park``)."""
    state_hooks: list[RemovableHandle]
    """The ``model_state`` hooks' handles."""


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ElixirConfig | None = None,
    example_batch: object | None = None,
    *,
    resident: Iterable[nn.Parameter] = (),
    plan: ElixirPlan | None = None,
) -> tuple[nn.Module, ElixirOptimizer]:
    """Installs the Elixir engine on ``model`` in place and returns ``(model, elixir_optimizer)``.

    ``example_batch`` (what ``model(**batch)`` is called with) lets the engine trace the order in
    which parameters are used, so chunks follow the forward pass; without it, registration order.
    With ``mode="auto"`` on a GPU it is also the batch whose training step is profiled (on fake
    tensors) for the search, which picks chunk size, rCache size and offloaded chunks.

    ``resident``: parameters the model's forward reads without calling the module that holds them
    (a patched forward that multiplies by ``lm_head.weight`` itself, as TRL's fused LM head does).
    The engine gathers a unit's chunks in that unit's hooks, so such a read would see a zero
    placeholder, silently. Each of these parameters gets a private chunk (never evicted; counted in
    ``plan.memory.private``) that every forward of ``model`` gathers first; its gradient is written
    back, reduced and updated like any other's.

    ``plan``: a plan to follow (``ElixirPlan.from_json`` of a plan file): its choices
    (``ElixirPlan.settings()``) replace the config's, and the layout this model gives must be the
    one it describes, checked before anything is allocated (``PlanMismatch``).
    """
    config = config or ElixirConfig()
    if plan is not None:
        config = replace(config, **plan.settings())
    _check_model(model)
    decoupled = _check_optimizer(optimizer)
    device = _resolve_device(config)
    dtype = config.compute_dtype or _model_dtype(model)
    coll = Collectives(config.process_group)
    source = weight_source(model, coll, device)

    units = find_units(model, config.unit_classes)
    group_of = _param_groups(optimizer, model)
    _limit_gpu_memory(device, config.gpu_memory_bytes)
    # gradient shards come and go during each backward (chunk/store.py): page-mapped segments keep that from fragmenting
    expandable = device.type == "cuda" and expandable_segments()
    job = PlanJob(
        model,
        units,
        example_batch,
        config,
        device,
        dtype,
        coll,
        param_group=lambda p: group_of[id(p)],
        resident=tuple(resident),
        grads_share_activations=expandable,
        follow=plan,
    )
    planned = plan_job(job)
    plan, live = planned.plan, planned.live
    if coll.rank == 0:  # the HF integration prints it; a debug record for runtime-only users
        logger.debug("Elixir plan:\n%s", plan_table(plan))

    params = live.param_table.params
    orig_dtypes = [p.dtype for p in params]
    _move_buffers(model, device, source)
    unmeta_parameters(params)
    adam = adam_state(plan.moments)
    memory = PlannedMemory(plan.device_bytes, plan.memory.activations, plan.batch_shape, plan.activations)
    ctx = EngineContext(coll, device, dtype, Lockstep(coll, config.lockstep_timeout_s), adam, memory=memory)
    lane = DeviceLane(plan.device_lane, device, dtype, adam) if plan.device_lane else None
    with source.reading(device):  # streamed weights: a failed read fails prepare on every rank
        runtime = ChunkRuntime(
            ctx,
            live.layout,
            plan.placement(),
            plan.n_blocks,
            config.prefetch,
            weights=source.part,
            lane=lane,
            grads_share_activations=live.grad_window.shares,
            root_chunks=live.root_chunks,
        )
    detach_weights(model)
    held = HeldInputs(device) if plan.activations == "host" else None
    hooks = install_hooks(model, units, live.unit_chunks, runtime, plan.batch_guard(), held)
    model_state = ModelStateHooks(runtime, orig_dtypes)
    state_hooks = model_state.install(model)
    threads = cpu_adam_threads(local_ranks(), config.cpu_threads)
    elixir_optimizer = ElixirOptimizer(
        optimizer,
        runtime,
        decoupled=decoupled,
        loss_scale=config.loss_scale,
        cpu_threads=threads,
        skip_nonfinite=config.skip_nonfinite,
        max_consecutive_skips=config.max_consecutive_skips,
        rate_probe=_rate_probe(plan, ctx, threads) if config.record_update_rate else None,
    )
    state = ElixirState(runtime, plan, live, units, elixir_optimizer, model_state, hooks, state_hooks)
    model._elixir = state  # type: ignore[assignment]  # Module.__setattr__ takes any value (typed: tensors, modules)
    return model, elixir_optimizer


@torch.no_grad()
def release(model: nn.Module) -> None:
    """Takes the engine off ``model``, which ``prepare`` may then take again (with another optimizer,
    batch or config): each parameter gets its trained value in a storage of its own (host memory, its
    original dtype, as a model is before ``prepare``), every hook of the engine comes off, and the
    engine's memory is freed (its arenas, pinned host memory included, and rCache), even where an old
    optimizer or Trainer still refers to it: that optimizer can no longer step. A collective (the
    weights are gathered): call it on every rank, between steps.

    [Note: releasing an engine]
    Between the gather and the free the host holds the model in its dtypes beside the arenas: a
    big model's release peaks at that. The arenas are freed by shrinking their storages to nothing
    (FSDP's way with its flat parameters): views of them (the optimizer's kernels', a chunk's
    gradient shard) keep no memory alive, and any later use of one fails at once instead of reading
    stale values. Pinned host arenas are unregistered from CUDA first (``host_memory.unpin_host``).
    """
    elixir = getattr(model, "_elixir", None)
    if elixir is None:
        raise ValueError("release needs a model prepared by elixir_runtime.prepare")
    rt = elixir.runtime
    rt.unpark()
    values = elixir.model_state.full_params()
    elixir.hooks.remove()
    for h in elixir.state_hooks:
        h.remove()
    for p, v in zip(rt.layout.params, values, strict=True):
        assert v is not None, "every rank keeps the weights outside rank0_state_dict"
        p.data = v
    _free(rt)
    del model._elixir


def _free(rt: ChunkRuntime) -> None:
    """Every tensor of the engine's memory shrunk to nothing ([Note: releasing an engine])."""
    rt.host_updates.close()
    tensors = [t for a in rt.arenas.values() for t in _tensors_of(a)]
    tensors += [b.data for b in rt.rcache.buffers] + [c.buffer.data for c in rt.chunks if c.buffer is not None]
    for c in rt.chunks:
        c.grad = None
    for t in tensors:
        unpin_host(t)
        t.untyped_storage().resize_(0)


def _tensors_of(arenas: object) -> list[torch.Tensor]:
    """The arenas' tensors (``chunk/store.ShardArenas``): its tensor fields and those of a field
    holding them by name (``.tensors``)."""
    out = []
    for value in vars(arenas).values():
        held = getattr(value, "tensors", None)
        for t in [value, *(held.values() if isinstance(held, dict) else ())]:
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _rate_probe(plan: ElixirPlan, ctx: EngineContext, threads: int) -> UpdateRateProbe | None:
    """Where the CPU updates offloaded chunks beside a GPU without the device lane: a probe whose
    report records the job's rate into this machine's cached profile ([Note: the run's own rate])."""
    if not ctx.cuda or not plan.offload or plan.device_lane:
        return None
    ranks = local_ranks()
    return UpdateRateProbe(
        ctx.stats, lambda rate: record_update_rate(ctx.coll, ctx.device, ranks, threads, rate, ctx.state)
    )


def _check_model(model: nn.Module) -> None:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if hasattr(model, "_elixir"):
        raise ValueError(
            "this model is already prepared by Elixir: call elixir_runtime.release(model) first to prepare it again"
        )
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise TypeError(
            f"model is wrapped in {type(model).__name__}; pass the bare module (model.module): Elixir shards and "
            "reduces gradients itself"
        )
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch without distributed
        return
    for m in model.modules():
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
            raise TypeError(
                "model is already sharded by FSDP; Elixir and FSDP cannot be combined: build the model without "
                "fully_shard/FSDP and let Elixir shard it"
            )


def _check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Accepts Adam/AdamW only; returns whether weight decay is decoupled (AdamW)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"Elixir runs Adam or AdamW over chunk shards, got {type(optimizer).__name__}: "
            "create torch.optim.AdamW(model.parameters(), ...) (or Adam) and pass that"
        )
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(
                    f"{flag}=True is not supported by the Elixir optimizer; create the optimizer without it"
                )
    return isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))


def _param_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, int]:
    """``id(param)`` → its optimizer group; all trainable params of the model must be in the optimizer."""
    group_of: dict[int, int] = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    named = list(model.named_parameters())
    model_ids = {id(p) for _, p in named}
    if any(pid not in model_ids for pid in group_of):
        raise ValueError("the optimizer holds parameters that are not in the model; build it from model.parameters()")
    missing = [name for name, p in named if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters are not in the optimizer (e.g. {missing[:3]}); pass all of "
            "model.parameters() or set requires_grad=False on the ones to freeze"
        )
    return group_of


def _limit_gpu_memory(device: torch.device, gpu_memory: int | None) -> None:
    """Before the plan, which then fits the limit: the allocator enforces ``gpu_memory`` from here on."""
    if device.type == "cuda":
        limit_gpu_memory(device, gpu_memory)
    elif gpu_memory is not None:
        logger.warning(
            "elixir: ElixirConfig.gpu_memory=%d bytes is ignored: this run computes on %s, not a GPU",
            gpu_memory,
            device,
        )


def _resolve_device(config: ElixirConfig) -> torch.device:
    if config.device is not None:
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as torch reads it
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _move_buffers(model: nn.Module, device: torch.device, source: WeightSource) -> None:
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = source.value(b).to(device)
