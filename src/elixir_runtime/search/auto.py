"""``ElixirConfig(mode="auto")`` inside ``prepare``: profile, hardware, budget, search.

``search_model`` is the decision itself (profile → unit order → budget → search), shared with
``elixir-plan``, which gives it a hardware profile and a budget for a GPU it does not have: the
same inputs make the same plan. Runs before any training memory exists. Every rank first times the engine's collectives on the
job's own process group (the bandwidth the plan's gathers and reductions will get) and gets the
hardware profile (``hardware.load.job_hardware``: rank 0 loads or measures it; the per-rank CPU
Adam of this host's ranks, if this machine's profile lacks it, all ranks measure at once); then
rank 0 decides and broadcasts, so every rank builds the same layout: free memory differs a little
from GPU to GPU.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..chunk.collectives import Collectives
from ..config import ElixirConfig, device_lane_wanted
from ..profiler.kernels import cuda_attention
from ..profiler.profile import ModelProfile, profile_model, structural_profile
from ..units import Unit, param_table
from ..host import local_ranks
from .budget import F_FRAG, Budget, device_budget
from .loop import SearchResult, SearchSettings, search
from ..hardware.load import job_hardware
from ..hardware.profile import HardwareProfile
from ..hardware.measure import collective_busbw

__all__ = ["auto_plan", "search_model", "UNPROFILED_ACTIVATION_SHARE"]

logger = logging.getLogger(__name__)

UNPROFILED_ACTIVATION_SHARE = 0.4
"""Without an example batch the activations are unknown: this share of the GPU is kept for them."""


def auto_plan(
    model: nn.Module,
    units: list[Unit],
    example_batch: Any | None,
    config: ElixirConfig,
    device: torch.device,
    dtype: torch.dtype,
    coll: Collectives,
    grads_share_activations: bool = True,
) -> tuple[list[int], SearchResult]:
    """(unit indices in first-use order, the search's choice), identical on every rank;
    ``grads_share_activations``: ``SearchSettings.grads_share_activations``."""
    busbw = collective_busbw(coll, device, dtype) if coll.world_size > 1 else None
    hardware = job_hardware(coll, device, config.cpu_threads)

    def budget(profile: ModelProfile) -> Budget:
        return device_budget(device, profile.activation_peak, profile.buffer_bytes, local_ranks())

    def decide() -> tuple[list[int], SearchResult]:
        order, result, _ = search_model(
            model, units, example_batch, config, device, dtype, coll.world_size, hardware, budget, busbw=busbw,
            grads_share_activations=grads_share_activations,
        )
        return order, result

    return coll.decided_by_rank0(decide, device)


def search_model(
    model: nn.Module,
    units: list[Unit],
    batch: Any | None,
    config: ElixirConfig,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    hardware: HardwareProfile,
    budget_of: Callable[[ModelProfile], Budget],
    *,
    busbw: float | None = None,
    grads_share_activations: bool = True,
    exact: bool = False,
) -> tuple[list[int], SearchResult, ModelProfile]:
    """(unit indices in first-use order, the search's choice, the profile) for ``model`` trained on
    ``batch`` by ``world_size`` ranks with ``hardware``; ``budget_of(profile)``: the memory budget."""
    profile = _profile(model, units, batch, dtype, device, exact)
    order = profile.unit_indices(units)
    budget = budget_of(profile)
    if batch is None:
        budget.activations = int(UNPROFILED_ACTIVATION_SHARE * budget.capacity / F_FRAG)
    settings = SearchSettings(world_size, dtype, config, busbw=busbw, device_lane=device_lane_wanted(config, device),
                              grads_share_activations=grads_share_activations)
    result = search(param_table(model, units, order), profile, hardware, budget, settings)
    result.notes.insert(0, f"hardware: {hardware.device}, {hardware.source}")
    result.notes.insert(1, f"profile: {profile.seconds:.2f} s; activation peak at {profile.peak_at}")
    return order, result, profile


def _profile(
    model: nn.Module, units: list[Unit], batch: Any | None, dtype: torch.dtype, device: torch.device, exact: bool = False
) -> ModelProfile:
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
        logger.info("elixir: profile on fake %s tensors failed (%s: %s); retrying on fake CPU ones", device, type(exc).__name__, exc)
    try:
        with cuda_attention():
            return profile_model(model, batch, dtype=dtype, device="cpu", units=units, exact=exact)
    except Exception as exc:  # model code that cannot run on fake tensors (data-dependent control flow)
        logger.warning("elixir: the fake-tensor profile failed (%s: %s); planning without it", type(exc).__name__, exc)
        return _profile(model, units, None, dtype, device)
