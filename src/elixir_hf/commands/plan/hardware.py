"""What ``elixir-plan`` plans for: the GPU's hardware profile and the host memory beside it, and
where each comes from, in the words of the plan's header.

The GPU: ``--gpu NAME`` (a shipped card), ``--hardware`` (a shipped card or a profile file),
``$ELIXIR_HARDWARE``, else this machine's GPU (measured once and cached), and without a GPU the
shipped h100. The host goes with the GPU's profile: planning for this machine's own GPU, this
machine's available RAM (what ``--elixir auto`` budgets with at ``prepare``); for any other, the
profile's host's RAM (for a derived card, the H100 box it derives from), never this machine's
RAM beside another machine's card. ``--host-mem SIZE`` or ``--host-mem here`` (this machine's
available RAM) plan with other RAM.

A profile's host fed ``hardware.gpus`` GPUs; a plan for more GPUs on another machine's profile (8 H100s
from the 1-GPU h100 box) assumes a host of as many such boxes per GPU: RAM and cores scaled by the
GPUs, said in the header. ``--host-cores N`` sets the cores: each rank's CPU Adam rate is the
profile's at the same cores per rank (``host_hardware``). Card names are matched loosely
(``RTX-4090``, ``rtx 4090``, ``nvidia-h100``: ``card_name``).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch

from elixir_runtime.hardware import (
    ENV_HARDWARE,
    MEASURED,
    REFERENCE,
    SHIPPED,
    HardwareProfile,
    host_available,
    load_hardware,
    unknown_card,
)

from .sizes import parse_size

__all__ = ["HERE", "card_name", "host_mem", "plan_hardware", "host_memory", "host_cores", "host_hardware"]

GIB = 2**30

HERE = "here"
"""``--host-mem here``: this machine's available RAM, whatever card is planned for."""

_NO_GPU = "no GPU here and no --gpu or --hardware"
_MEASURED = "the shipped profile, measured on that card"
_DERIVED = f"derived from the shipped {REFERENCE} profile and the card's published figures (--verbose says how)"


def host_mem(text: str) -> int | str:
    """``--host-mem``: a size (``parse_size``), or ``here``."""
    if text.lower() == HERE:
        return HERE
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or '{HERE}' for this machine's available RAM") from None


def card_name(value: str) -> str:
    """The shipped card ``value`` names in another spelling (case, ``-``, ``_``, spaces, an ``nvidia``
    prefix: ``RTX-4090`` is ``rtx4090``); ``value`` itself if none does, or if it is a file."""
    if Path(value).exists():
        return value
    key = re.sub(r"[\s_-]", "", value.lower()).removeprefix("nvidia")
    return next((name for name in SHIPPED if name.replace("-", "") == key), value)


def plan_hardware(args: argparse.Namespace) -> tuple[HardwareProfile, str]:
    """The GPU profile to plan with, and where it comes from in words ("" for this machine's GPU).
    Raises ``ValueError`` naming the flag, the value and the fix."""
    given = _given(args)
    if given is None:
        return load_hardware(), ""
    flag, value = given
    if flag == "--gpu" and value.lower() not in SHIPPED:
        raise ValueError(f"--gpu {value}: {unknown_card(value)}")
    try:
        hardware = load_hardware(value)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {value}: {exc}") from None
    if hardware.cpu_only:
        raise ValueError(
            f"{flag} {value}: {hardware.source or 'the profile'} was measured on a CPU (device 'cpu'): a GPU plan "
            f"needs a GPU's rates; pass --gpu {'|'.join(SHIPPED)} or a profile measured with --measure-hardware on "
            "the GPU machine"
        )
    if value.lower() not in SHIPPED:
        return hardware, f"{flag} {value}: {hardware.source}"
    if flag == _NO_GPU:
        return hardware, (
            f"{flag}: planned for the shipped {value} profile (its card and host). For another card: --gpu NAME "
            "(elixir-plan --help lists them), or measure it with `elixir-plan --measure-hardware hw.json` and pass "
            "--hardware hw.json"
        )
    return hardware, f"{flag} {value}: {_MEASURED if value.lower() in MEASURED else _DERIVED}"


def _boxes(args: argparse.Namespace, hardware: HardwareProfile) -> float:
    """How many of the profile's hosts a plan for ``args.gpus`` GPUs of another machine assumes (1: its own)."""
    if _given(args) is None or args.gpus <= hardware.gpus:
        return 1.0
    return float(args.gpus / hardware.gpus)


def _profile_host(args: argparse.Namespace, hardware: HardwareProfile) -> str:
    given = _given(args)
    derived = given is not None and given[1].lower() in SHIPPED and given[1].lower() not in MEASURED
    whose = f"the {REFERENCE} box the profile derives from" if derived else "the machine the profile was measured on"
    gpus = f"{hardware.gpus} GPU{'s' if hardware.gpus > 1 else ''}"
    return f"{whose}: {hardware.host_memory / GIB:.0f} GiB, {hardware.cpu_cores} cores for {gpus}"


def host_cores(args: argparse.Namespace, hardware: HardwareProfile) -> tuple[int, str]:
    """Host cores to price the CPU Adam with, and where they come from."""
    if args.host_cores is not None:
        return args.host_cores, "--host-cores"
    boxes = _boxes(args, hardware)
    if boxes > 1:
        return round(hardware.cpu_cores * boxes), "assumed: the profile's host's per GPU; --host-cores N for yours"
    return hardware.cpu_cores, "the profile's host's"


def host_memory(args: argparse.Namespace, hardware: HardwareProfile) -> tuple[int, str]:
    """Host RAM to plan with, and where it comes from (module docstring)."""
    cores, cores_source = host_cores(args, hardware)
    rates = f", CPU Adam rates for {cores} cores ({cores_source})"
    if isinstance(args.host_mem, int):
        return args.host_mem, "as given (--host-mem)" + rates
    if args.host_mem == HERE:
        return host_available(), f"available on this machine (--host-mem {HERE})" + rates
    if _given(args) is None:
        return host_available(), "available on this machine" + (rates if args.host_cores else "")
    boxes = _boxes(args, hardware)
    if boxes > 1:
        return (
            round(hardware.host_memory * boxes),
            f"ASSUMED: {args.gpus} GPUs x the profile host's RAM and cores per GPU ({_profile_host(args, hardware)}): "
            f"{hardware.host_memory * boxes / GIB:.0f} GiB, {cores} cores; --host-mem SIZE and --host-cores N for "
            "your host",
        )
    return (
        hardware.host_memory,
        f"the profile's host's ({_profile_host(args, hardware)}; its CPU Adam rates"
        + (f" for {cores} cores, --host-cores" if args.host_cores else "")
        + f"); --host-mem SIZE or {HERE} for another",
    )


def host_hardware(args: argparse.Namespace, hardware: HardwareProfile) -> HardwareProfile:
    """``hardware`` on a host of ``host_cores`` cores (``HardwareProfile.on_host``)."""
    cores, _ = host_cores(args, hardware)
    if cores == hardware.cpu_cores:
        return hardware
    return hardware.on_host(args.gpus, cores)


def _given(args: argparse.Namespace) -> tuple[str, str] | None:
    """The flag naming the GPU's profile and its value; without any, on a machine without a GPU,
    the reference card; ``None``: this machine's GPU."""
    env = os.environ.get(ENV_HARDWARE)
    for flag, value in (("--gpu", args.gpu), ("--hardware", args.hardware), (f"${ENV_HARDWARE}", env)):
        if value:
            return flag, card_name(value)
    return None if torch.cuda.is_available() else (_NO_GPU, REFERENCE)
