"""Parameters a traced forward reads while no unit holding them runs.

The engine gathers a unit's chunks in the unit's forward hooks, so a forward that reads a parameter
without calling its module (Liger's fused linear cross entropy and TRL's fused LM head multiply by
``lm_head.weight`` themselves; any patched forward may) would read a placeholder. Found by what the
forward does, not by who patched it: every aten op of the fake forward is watched, and a fake
parameter among its inputs while none of its units is inside its call is read outside. The planner
gives such parameters chunks that the root's forward gathers (``units.ParamTable.resident``). Only the
forward is watched: backward reads what forward saved, and recomputation re-runs a unit's call.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves

from ..units import Unit

__all__ = ["OutsideReads", "parameters_named"]


class OutsideReads:
    """Watches ``units`` of a model in ``fake.fake_run``: ``fakes`` maps ``id(real parameter)`` to its
    fake, ``names`` ``id(real parameter)`` to its canonical name. ``found``: the names read outside."""

    def __init__(self, units: list[Unit], fakes: Mapping[int, torch.Tensor], names: Mapping[int, str]) -> None:
        self._modules = {id(u.module): (u.module, u.index) for u in units}
        self._units: dict[int, set[int]] = {}
        """``id(fake)`` → the units holding it."""
        self._names = {id(fakes[pid]): name for pid, name in names.items() if pid in fakes}
        for u in units:
            for p in u.params:
                if id(p) in fakes:
                    self._units.setdefault(id(fakes[id(p)]), set()).add(u.index)
        self._running: Counter[int] = Counter()
        self.found: dict[str, None] = {}
        """Names in the order first read outside."""

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watches the forward run inside it (unit calls by hooks, reads by a dispatch mode)."""
        handles = []
        for module, index in self._modules.values():
            handles.append(module.register_forward_pre_hook(lambda *_, i=index: self._enter(i)))
            handles.append(module.register_forward_hook(lambda *_, i=index: self._exit(i), always_call=True))
        try:
            with _Reads(self):
                yield
        finally:
            for h in handles:
                h.remove()

    def read(self, t: object) -> None:
        owners = self._units.get(id(t))
        if owners is not None and not any(self._running[u] for u in owners):
            self.found.setdefault(self._names[id(t)], None)

    def _enter(self, unit: int) -> None:
        self._running[unit] += 1

    def _exit(self, unit: int) -> None:
        self._running[unit] -= 1


class _Reads(TorchDispatchMode):
    def __init__(self, watch: OutsideReads) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.watch = watch

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for t in arg_tree_leaves(*args, **kwargs):
            self.watch.read(t)
        return func(*args, **kwargs)


def parameters_named(model: nn.Module, names: list[str]) -> list[nn.Parameter]:
    """The parameters of ``model`` under ``names`` (canonical names, as ``found`` gives them)."""
    by_name = dict(model.named_parameters())
    return [by_name[n] for n in names]
