"""Which hardware profile a plan uses: a shipped card, a file, or this machine's, measured once and cached.

A profile is cached per machine under ``~/.cache/elixir/`` (``$ELIXIR_CACHE_DIR``) and can be
replaced by a file (``--hardware``, ``$ELIXIR_HARDWARE``), e.g. one measured on the GPU machine a
plan is made for, or by the name of a profile shipped with the package (``SHIPPED``: measured on
that card with ``elixir-plan --measure-hardware``), which is what ``elixir-plan`` plans with on a
machine without a GPU: a GPU plan is never timed with a CPU's rates.
"""

from __future__ import annotations

import os
import platform
from importlib import resources
from pathlib import Path

from . import measure
from .profile import PROFILE_VERSION, HardwareProfile

__all__ = ["cache_path", "machine_key", "load_hardware", "shipped_hardware", "ENV_HARDWARE", "SHIPPED"]

ENV_HARDWARE = "ELIXIR_HARDWARE"

SHIPPED = {"h100": "h100.json"}
"""Profiles measured on a card and shipped in ``hardware/profiles/``, by the name ``--hardware`` takes
(h100: NVIDIA H100 80GB HBM3 with 16 cores and 126 GiB of host RAM, one GPU's PCIe link)."""


def shipped_hardware(name: str) -> HardwareProfile:
    """The shipped profile ``name`` (``SHIPPED``); its ``source`` says it is the shipped one."""
    if name.lower() not in SHIPPED:
        raise ValueError(f"no shipped hardware profile {name!r}: use one of {sorted(SHIPPED)} or a profile JSON file")
    text = resources.files(__package__).joinpath("profiles", SHIPPED[name.lower()]).read_text()
    profile = HardwareProfile.from_json(text)
    profile.source = f"shipped profile {name.lower()!r}, {profile.source}"
    return profile


def cache_path(key: str | None = None) -> Path:
    """``~/.cache/elixir/hardware-<machine>.json`` (``$ELIXIR_CACHE_DIR`` overrides the root)."""
    root = Path(os.environ.get("ELIXIR_CACHE_DIR") or Path.home() / ".cache" / "elixir")
    return root / f"hardware-{key or machine_key()}.json"


def machine_key() -> str:
    """Host name and GPU model/count: a profile is reused only on the same machine."""
    import torch

    gpus = "cpu"
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()}x{torch.cuda.get_device_name(0)}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{platform.node()}-{gpus}")


def load_hardware(path: str | Path | None = None, *, refresh: bool = False, quick: bool = False) -> HardwareProfile:
    """A shipped profile's name or a file (``path`` or ``$ELIXIR_HARDWARE``) if given, else this
    machine's cached profile, measured (and cached) on first use."""
    path = path or os.environ.get(ENV_HARDWARE)
    if path and str(path).lower() in SHIPPED:
        return shipped_hardware(str(path))
    if path:
        return HardwareProfile.load(path)
    cached = cache_path()
    if cached.exists() and not refresh:
        profile = HardwareProfile.load(cached)
        if profile.version >= PROFILE_VERSION:
            return profile
    profile = measure.measure_hardware(quick=quick)
    profile.save(cached)
    return profile
