"""Hooks that mark the traced step: block boundaries, fetch-unit events, checkpointed regions.

* Blocks: a block's forward pre-hook opens its forward segment; the gradient reaching its output
  opens its backward segment; the gradient reaching block 0's input opens the tail.
* Units: the same two moments the engine acquires chunks at (``runtime/hooks.py``): every
  forward call (also a recomputation inside a checkpointed region), and the first gradient
  reaching the outputs of a call made with grad enabled.
* Checkpointed regions: HF layers call ``self._gradient_checkpointing_func`` (set by
  ``gradient_checkpointing_enable``); plain models call ``torch.utils.checkpoint.checkpoint``.
  Both are wrapped for the duration of the trace so each call is recorded with the parameters
  its forward touches, and its arguments that the last unit returned as held block inputs
  (``hold``; the engine's rule, ``runtime/held_inputs.py``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_leaves

from ..units import Unit
from .blocks import BlockStack
from .timeline import Timeline

__all__ = ["Markers"]


_R = TypeVar("_R")


def _grad_tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


class Markers:
    """Installs the hooks on construction; ``remove()`` undoes every one of them."""

    def __init__(
        self,
        model: nn.Module,
        timeline: Timeline,
        units: list[Unit],
        stack: BlockStack | None,
        hold: Callable[[torch.Tensor], None] = lambda _t: None,
    ) -> None:
        self.tl = timeline
        self.hold = hold
        self.last: list[weakref.ref[torch.Tensor]] = []
        """What the last unit to finish a forward returned (its tensors that need grad), weakly: a strong
        reference would keep the head's output (the logits) alive through the traced backward, which
        the run frees once the loss's backward is done."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._restore: list[Callable[[], None]] = []
        if stack is not None:
            self._mark_blocks(list(cast(nn.ModuleList, stack.parent._modules[stack.attr])))
        for unit in units:
            self._mark_unit(unit)
        self._wrap_checkpoints(model)

    def remove(self) -> None:
        self.last = []
        for h in self._handles:
            h.remove()
        for undo in reversed(self._restore):
            undo()
        self._handles.clear()
        self._restore.clear()

    # ------------------------------------------------------------------ blocks
    def _mark_blocks(self, blocks: list[nn.Module]) -> None:
        last = len(blocks) - 1
        for i, block in enumerate(blocks):

            def pre(_m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], i: int = i) -> None:
                if self.tl.phase != "fwd":
                    return
                self.tl.mark("fwd", i)
                if i == 0:
                    for t in _grad_tensors((args, kwargs))[:1]:
                        t.register_hook(lambda _g: self.tl.mark("post"))

            def post(
                _m: nn.Module, _args: tuple[object, ...], _kwargs: dict[str, object], output: object, i: int = i
            ) -> None:
                if self.tl.phase != "fwd":
                    return
                for t in _grad_tensors(output)[:1]:
                    t.register_hook(lambda _g, i=i: self.tl.mark("bwd", i))
                if i == last:
                    self.tl.mark("mid")

            self._handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(block.register_forward_hook(post, with_kwargs=True))

    # ------------------------------------------------------------------ units
    def _mark_unit(self, unit: Unit) -> None:
        def pre(_m: nn.Module, _args: tuple[object, ...]) -> None:
            self.tl.unit_event(unit.name)

        def post(_m: nn.Module, _args: tuple[object, ...], output: object) -> None:
            if torch.is_grad_enabled():
                outs = _grad_tensors(output)
                if self.tl.phase == "fwd":
                    self.last = [weakref.ref(t) for t in outs]
                if outs:
                    handle = torch.autograd.graph.register_multi_grad_hook(
                        outs, lambda _g: self.tl.unit_event(unit.name), mode="any"
                    )
                    self._handles.append(handle)

        self._handles.append(unit.module.register_forward_pre_hook(pre))
        self._handles.append(unit.module.register_forward_hook(post))

    # ------------------------------------------------------------------ checkpointed regions
    def _wrap_checkpoints(self, model: nn.Module) -> None:
        self._names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
        for name, module in model.named_modules():
            fn = module.__dict__.get("_gradient_checkpointing_func")
            if fn is not None:
                module._gradient_checkpointing_func = self._region(fn, name or "<root>")
                self._restore.append(functools.partial(setattr, module, "_gradient_checkpointing_func", fn))
        original = torch.utils.checkpoint.checkpoint
        torch.utils.checkpoint.checkpoint = self._region(original, None)
        self._restore.append(functools.partial(setattr, torch.utils.checkpoint, "checkpoint", original))

    def _region(self, checkpoint: Callable[..., _R], name: str | None) -> Callable[..., _R]:
        @functools.wraps(checkpoint)
        def recorded(function: Callable[..., object], *args: object, **kwargs: object) -> _R:
            region = self.tl.region_begin(name or self._name_of(function))
            if region is not None and torch.is_grad_enabled():
                for a in args:
                    if isinstance(a, torch.Tensor) and any(a is o() for o in self.last):
                        self.hold(a)
            try:
                return checkpoint(function, *args, **kwargs)
            finally:
                self.tl.region_end(region)

        return recorded

    def _name_of(self, function: Callable[..., object]) -> str:
        owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
        if owner is None and isinstance(function, functools.partial):
            owner = function.args[0] if function.args else None
        return self._names.get(id(owner), str(getattr(function, "__qualname__", "checkpoint")))
