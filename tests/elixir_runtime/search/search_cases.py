"""Shared inputs of the search tests: a synthetic GPU-like hardware profile and profiled models.

The hardware numbers are test data (a made-up GPU host of the right orders of magnitude), never
used by the library itself, which measures its machine.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from elixir_runtime.hardware import HardwareProfile, LinkRates
from elixir_runtime.hardware.profile import CpuAdamRate
from elixir_runtime.profiler import ModelProfile, profile_model
from elixir_runtime.units import ParamTable, find_units, param_table
from helpers.models import MODEL_BUILDERS, make_batch

GIB = 2**30


def gpu_host(gpus: int = 1, cpu_adam: float = 5e9) -> HardwareProfile:
    """``cpu_adam``: the one-rank rate (ranks of a job on more share it: ``HardwareProfile.rates``)."""
    return HardwareProfile(
        device="test GPU",
        gpus=gpus,
        gpu_memory=80 * GIB,
        host_memory=256 * GIB,
        cpu_cores=16,
        matmul={"256": 50e12, "1024": 300e12, "4096": 600e12},
        attention={"2048": 300e12},
        memory_bandwidth=3e12,
        op_overhead=1e-5,
        gpu_adam=80e9,
        cpu_adam={1: CpuAdamRate(1, 15, cpu_adam, cpu_adam)},
        links={n: LinkRates(n, 50e9 * n, 50e9 * n, 35e9 * n, 200e9 if n > 1 else None) for n in range(1, gpus + 1)},
        source="test data",
    )


def cpu_adam_times(hardware: HardwareProfile, factor: float) -> HardwareProfile:
    """``hardware`` with every CPU Adam rate ``factor`` times as fast."""
    return dataclasses.replace(
        hardware,
        cpu_adam={
            n: dataclasses.replace(r, under_copies=r.under_copies * factor, alone=r.alone and r.alone * factor)
            for n, r in hardware.cpu_adam.items()
        },
    )


def profiled(
    kind: str = "gpt2",
    n_layer: int = 6,
    ac: bool = True,
    batch: int = 2,
    seq: int = 16,
    resident: tuple[str, ...] = (),
    **kw,
) -> tuple[nn.Module, ParamTable, ModelProfile]:
    """``resident``: names of parameters read outside their units (``prepare``'s ``resident``)."""
    model = MODEL_BUILDERS[kind](n_layer=n_layer, **kw)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    units = find_units(model, None)
    profile = profile_model(model, make_batch(128, batch=batch, seq=seq), device="cpu", units=units)
    by_name = {u.name: u.index for u in units}
    order = [by_name[n] for n in profile.unit_order()]
    order += [u.index for u in units if u.index not in order]
    params = dict(model.named_parameters())
    return model, param_table(model, units, order, [params[n] for n in resident]), profile


def model_state_bytes(model: nn.Module) -> int:
    """bf16 param + grad, fp32 master, m, v: 16 bytes per parameter."""
    return 16 * sum(p.numel() for p in model.parameters())


__all__ = ["gpu_host", "profiled", "model_state_bytes", "GIB"]
