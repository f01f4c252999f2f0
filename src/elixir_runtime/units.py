"""Fetch units: the modules whose forward/backward hooks gather and release chunks (FSDP2 style).

A unit is a transformer block (the model's ``_no_split_modules``) or any other module that holds
parameters outside every block. All chunks holding a unit's parameters are resident while the
unit runs, so the rCache can be no smaller than the largest unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

__all__ = ["Unit", "find_units"]


@dataclass(eq=False)
class Unit:
    """One hooked module and the parameters it needs resident (filled with chunk ids by the engine)."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    chunks: tuple[int, ...] = ()
    bwd_pinned: bool = field(default=False, repr=False)


def _matches(module: nn.Module, classes: Sequence[type | str]) -> bool:
    return any(isinstance(module, c) if isinstance(c, type) else type(module).__name__ == c for c in classes)


def find_units(model: nn.Module, unit_classes: Sequence[type | str] | None) -> list[Unit]:
    """Units in registration order; ``unit_classes=None`` uses ``model._no_split_modules``."""
    classes = list(unit_classes) if unit_classes is not None else list(getattr(model, "_no_split_modules", None) or [])
    units: list[Unit] = []
    inside: set[str] = set()  # names of modules absorbed by a block unit

    def absorbed(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in inside)

    for name, module in model.named_modules():
        if absorbed(name):
            continue
        if classes and _matches(module, classes) and module is not model:
            params = _unique(module.parameters())
            if params:
                inside.add(name)
                units.append(Unit(len(units), name, module, params))
            continue
        direct = _unique(module.parameters(recurse=False))
        if direct:
            units.append(Unit(len(units), name or "<root>", module, direct))
    return units


def _unique(params) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def unit_owner_count(units: list[Unit]) -> dict[int, int]:
    """How many units hold each parameter (by ``id``): more than one means tied/shared."""
    count: dict[int, int] = {}
    for u in units:
        for p in u.params:
            count[id(p)] = count.get(id(p), 0) + 1
    return count


def param_bytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
