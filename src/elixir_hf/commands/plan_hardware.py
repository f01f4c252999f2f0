"""What ``elixir-plan`` plans for: the GPU's hardware profile and the host memory beside it, and
where each comes from, in the words of the plan's header.

The GPU: ``--gpu NAME`` (a shipped card), ``--hardware`` (a shipped card or a profile file),
``$ELIXIR_HARDWARE``, else this machine's GPU (measured once and cached), and without a GPU the
shipped h100. The host goes with the GPU's profile: planning for this machine's own GPU, this
machine's available RAM (what ``--elixir auto`` budgets with at ``prepare``); for any other, the
profile's host's RAM (for a derived card, the H100 box it derives from), never this machine's
RAM beside another machine's card. ``--host-mem SIZE`` or ``--host-mem here`` (this machine's
available RAM) plan with other RAM; the CPU Adam rates stay the profile's host's.
"""

from __future__ import annotations

import argparse
import os

import torch

from elixir_runtime.config import parse_size
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

__all__ = ["HERE", "host_mem", "plan_hardware", "host_memory"]

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
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or '{HERE}' for this machine's available RAM") from None


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


def host_memory(args: argparse.Namespace, hardware: HardwareProfile) -> tuple[int, str]:
    """Host RAM to plan with, and where it comes from (module docstring)."""
    rates = f", with the CPU Adam rates of the profile's host ({hardware.cpu_cores} cores)"
    if isinstance(args.host_mem, int):
        return args.host_mem, "as given (--host-mem)" + rates
    if args.host_mem == HERE:
        return host_available(), f"available on this machine (--host-mem {HERE})" + rates
    given = _given(args)
    if given is None:
        return host_available(), "available on this machine"
    derived = given[1].lower() in SHIPPED and given[1].lower() not in MEASURED
    whose = f"the {REFERENCE} box the profile derives from" if derived else "the machine the profile was measured on"
    return (
        hardware.host_memory,
        f"the profile's host's ({whose}: {hardware.cpu_cores} cores, its CPU Adam rates); --host-mem SIZE or "
        f"{HERE} for another",
    )


def _given(args: argparse.Namespace) -> tuple[str, str] | None:
    """The flag naming the GPU's profile and its value; without any, on a machine without a GPU,
    the reference card; ``None``: this machine's GPU."""
    env = os.environ.get(ENV_HARDWARE)
    for flag, value in (("--gpu", args.gpu), ("--hardware", args.hardware), (f"${ENV_HARDWARE}", env)):
        if value:
            return flag, value
    return None if torch.cuda.is_available() else (_NO_GPU, REFERENCE)
