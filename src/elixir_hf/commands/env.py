"""``python -m elixir_hf.commands.env`` (``elixir-env``): what elixir-hf finds on this machine, for bug reports.

    python -m elixir_hf.commands.env          # a table
    python -m elixir_hf.commands.env --json   # one JSON object

It reports the package and library versions, the CPU Adam kernel offloaded chunks get (``cpp``, or
``torch`` and why: the C++ kernel is built here if it is not built yet, as on the first training
step), whether the fused GPU Adam (Triton) is ready, the GPUs, the host's RAM and cores, and the
hardware profile ``--elixir auto`` would plan with. It measures nothing and imports no
transformers code (versions come from the installed metadata).

The JSON object's keys: ``version``, ``location`` (the directory the packages were imported from), ``python``, ``platform``, ``torch``, ``cuda``, ``transformers``,
``accelerate``, ``triton`` (versions, ``null`` where not installed), ``cpu_adam`` (``"cpp"`` or
``"torch"``) and ``cpu_adam_detail`` (the build, or why not and the fix), ``triton_adam``
(``"triton"`` or ``"torch"``) and ``triton_adam_detail``, ``gpus`` (a list of ``{"name",
"memory_gib", "capability"}``), ``host_memory_gib``, ``cpu_cores`` (those this process may run on)
and ``hardware_profile`` (where ``auto``'s profile comes from).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

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

from .. import __version__

__all__ = ["environment", "main"]

_LIBRARIES = ("transformers", "accelerate", "triton")


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
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
        "location": str(Path(__file__).resolve().parents[2]),
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


def _text(env: dict[str, Any]) -> str:
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


class _NoCudaRuntime(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." (a CUDA wheel on a machine without a
    GPU, when the C++ Adam's build imports cpp_extension): the report's GPUs line says it in its place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="elixir-env", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    quiet, torch_log = _NoCudaRuntime(), logging.getLogger("torch.utils.cpp_extension")
    torch_log.addFilter(quiet)
    try:
        env = environment()
    finally:
        torch_log.removeFilter(quiet)
    print(json.dumps(env, indent=2) if args.json else _text(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
