"""The model as the planner and the engine see it: fetch units and the parameter table.

A unit is a transformer block (the model's ``_no_split_modules``) or any other module that holds
parameters outside every block; its forward/backward hooks gather and release chunks (FSDP2
style). All chunks holding a unit's parameters are gathered while the unit runs, so the rCache
can be no smaller than the largest unit. The parameter table lists the parameters in the order
and with the flags the chunk layout packs them with; ``prepare``, ``elixir-plan`` and the search
build it here, once.

A parameter the model's forward reads without calling the module that holds it (a patched forward
multiplying by ``lm_head.weight`` directly, e.g. TRL's fused LM head) would stay a placeholder:
``prepare(..., resident=...)`` names such parameters; the table marks them ``resident`` and, like
tied ones, ``private``, and the root's forward gathers their chunks (``runtime/hooks.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from torch import nn

from .config import ConfigError

__all__ = ["Unit", "find_units", "ParamTable", "param_table"]


@dataclass(frozen=True, eq=False)
class Unit:
    """One hooked module and the parameters it needs gathered."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]


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
    if unit_classes is not None:
        _check_classes_exist(model, classes)
    return units


def _check_classes_exist(model: nn.Module, classes: list[type | str]) -> None:
    """``ElixirConfig.unit_classes`` naming no module of the model would silently give other units."""
    missing = [c for c in classes if not any(_matches(m, [c]) for m in model.modules() if m is not model)]
    if missing:
        names = sorted(
            {type(m).__name__ for m in model.modules() if m is not model and any(True for _ in m.parameters())}
        )
        shown = [c if isinstance(c, str) else c.__name__ for c in missing]
        raise ConfigError(
            f"ElixirConfig.unit_classes names {shown}, which no module of this {type(model).__name__} is; its modules "
            f"holding parameters are {names}: name some of those, or None for the model's own blocks"
        )


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
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


@dataclass(frozen=True, eq=False)
class ParamTable:
    """The parameters in first-use order with what the layout needs of each."""

    params: list[nn.Parameter]
    names: list[list[str]]
    """Every name each parameter is reachable under (tied weights have several)."""
    groups: list[int]
    """Optimizer param group of each parameter, -1 for frozen ones."""
    private: list[bool]
    """Held by more than one unit (tied ``wte``/``lm_head``) or ``resident``: a private chunk of its own."""
    resident: list[bool]
    """Read outside its module's call (``prepare``'s ``resident``): the model's own forward gathers its
    (private) chunk before anything else runs."""
    units: list[Unit]

    @cached_property
    def index(self) -> dict[int, int]:
        """``id(param)`` → its position in the table."""
        return {id(p): i for i, p in enumerate(self.params)}

    @cached_property
    def by_name(self) -> dict[str, int]:
        return {n: i for i, names in enumerate(self.names) for n in names}


def param_table(
    model: nn.Module, units: list[Unit], unit_order: Sequence[int], resident: Collection[nn.Parameter] = ()
) -> ParamTable:
    """The table for ``units`` called in ``unit_order``; one optimizer group (``groups`` 0, -1 for
    frozen parameters) until ``prepare`` puts in the optimizer's. ``resident``: parameters read outside
    their module's call (see the module's docstring)."""
    params = list(dict.fromkeys(p for u in unit_order for p in units[u].params))
    index = {id(p): i for i, p in enumerate(params)}
    names: list[list[str]] = [[] for _ in params]
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in index:
            names[index[id(p)]].append(name)
    owners = unit_owner_count(units)
    outside = {id(p) for p in resident}
    unknown = outside - set(index)
    if unknown:
        raise ValueError(f"{len(unknown)} of the resident parameters are not parameters of this model's units")
    read_outside = [id(p) in outside for p in params]
    private = [owners[id(p)] > 1 or r for p, r in zip(params, read_outside)]
    return ParamTable(params, names, [0 if p.requires_grad else -1 for p in params], private, read_outside, units)
