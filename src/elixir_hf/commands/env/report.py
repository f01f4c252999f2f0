"""What ``elixir-env`` reports (its keys: ``__init__.py``): versions, the Adam kernels, GPUs, host and
the hardware profile, read with torch and the engine loaded."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

import torch

from elixir_runtime.hardware import (
    ENV_HARDWARE,
    SHIPPED,
    UNREADABLE,
    HardwareProfile,
    cache_path,
    cpu_kernel_status,
    gpu_kernel_status,
    host_total,
    usable_cores,
)

from ... import __version__

__all__ = ["environment", "report_text"]

_LIBRARIES = ("transformers", "accelerate", "triton")


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class _Gpu(TypedDict):
    name: str
    memory_gib: float
    capability: str


def _gpus() -> list[_Gpu]:
    if not torch.cuda.is_available():
        return []
    out: list[_Gpu] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"}
        )
    return out


def _hardware_profile() -> str:
    """Where ``--elixir auto``'s hardware profile comes from here (``hardware.load.job_hardware``)."""
    given = os.environ.get(ENV_HARDWARE)
    if given:
        kind = "the shipped profile" if given.lower() in SHIPPED else "the file"
        return f"{kind} {given!r} ({ENV_HARDWARE})"
    if not torch.cuda.is_available():
        return (
            "none: without a GPU `--elixir auto` makes a static plan (no hardware profile); elixir-plan uses the shipped "
            "h100 profile unless given --gpu or --hardware"
        )
    path = cache_path()
    if path.exists():
        recorded = _recorded_rates(path)
        return f"this machine's, cached at {path} (delete it to measure again){recorded}"
    return f"this machine's, measured on the first `--elixir auto` run (about a minute) and cached at {path}"


def _recorded_rates(path: Path) -> str:
    """The CPU update rates jobs recorded in the cached profile (docs/planning.md, "The run's own rate")."""
    try:
        profile = HardwareProfile.load(path)
    except UNREADABLE as exc:
        return f"; unreadable ({exc}): the next `--elixir auto` run measures it again"
    rates = [f"{r.observed / 1e9:.2f} with {n} per host" for n, r in sorted(profile.cpu_adam.items()) if r.observed]
    return f"; CPU updates of offloaded chunks ran here at {', '.join(rates)} (G params/s per rank)" if rates else ""


def environment() -> dict[str, Any]:
    """The report as one JSON-native object (keys in the module docstring); builds the C++ CPU
    Adam if it is not built yet."""
    cpu_adam, cpu_detail = cpu_kernel_status()
    triton_adam, triton_detail = gpu_kernel_status()
    return {
        "version": __version__,
        "location": str(Path(__file__).resolve().parents[3]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: _installed(name) for name in _LIBRARIES},
        "cpu_adam": cpu_adam,
        "cpu_adam_detail": cpu_detail,
        "triton_adam": triton_adam,
        "triton_adam_detail": triton_detail,
        "gpus": _gpus(),
        "host_memory_gib": round(host_total() / 2**30, 1),
        "cpu_cores": usable_cores(),
        "hardware_profile": _hardware_profile(),
    }


def report_text(env: dict[str, Any]) -> str:
    """The report as an aligned table."""
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB, sm {g['capability']})" for g in env["gpus"]) or "none"
    rows = [
        ("elixir-hf", f"{env['version']} ({env['location']})"),
        ("python", f"{env['python']} ({env['platform']})"),
        ("torch", f"{env['torch']} (CUDA {env['cuda'] or 'none'})"),
        *[(name, env[name] or "not installed") for name in _LIBRARIES],
        ("CPU Adam", f"{env['cpu_adam']}: {env['cpu_adam_detail']}"),
        ("GPU Adam", f"{env['triton_adam']}: {env['triton_adam_detail']}"),
        ("GPUs", gpus),
        ("host", f"{env['host_memory_gib']} GiB RAM, {env['cpu_cores']} cores"),
        ("hardware profile", env["hardware_profile"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
