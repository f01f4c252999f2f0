"""Weights a meta model carries for ``prepare`` to fill its chunk shards with, a range at a time.

A model whose parameters are on ``meta`` on every rank has no values; it carries where they come
from instead: safetensors files (``stream.StreamedWeights``, ``stream_weights``) or the model's
own init replayed on each rank's ranges (``init.InitWeights``, ``init_weights``). ``prepare``
(``source.weight_source``) reads each rank's shards from it; until then a forward pre-hook
refuses to run the model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["AttachedWeights", "attach_weights", "attached_weights", "detach_weights"]

_ATTR = "_elixir_weights"
"""The attribute of a model that carries its weights' source."""


class AttachedWeights(Protocol):
    @property
    def origin(self) -> str:
        """Where the values come from, for messages (``the files in /path``, ``the model's init``)."""
        ...

    fallback: str
    """How to build the model with its values instead (the fix an error names)."""
    params: list[nn.Parameter]
    """The meta parameters it holds the values of."""
    guard: RemovableHandle | None

    def covers(self, p: torch.Tensor) -> bool: ...

    def read(self, p: torch.Tensor, start: int, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``p``'s flattened value in ``p``'s dtype, on
        ``device`` or the CPU (the caller copies it into the shard)."""
        ...

    def check(self) -> str | None:
        """Why the values can no longer be read (a file moved); None if they can."""
        ...

    def agreement(self) -> object:
        """What every rank's source must share (compared before anything is read)."""
        ...

    def close(self) -> None: ...


def attach_weights(model: nn.Module, source: AttachedWeights) -> None:
    """``model`` carries ``source``; its forwards are refused until ``prepare`` read it (``unguard``)."""
    source.guard = model.register_forward_pre_hook(_refuse_before_prepare)
    setattr(model, _ATTR, source)


def unguard(source: AttachedWeights) -> None:
    """Lets the model run (``prepare`` traces it on fake tensors before it fills the chunks)."""
    if source.guard is not None:
        source.guard.remove()
        source.guard = None


def attached_weights(model: nn.Module) -> AttachedWeights | None:
    """The source attached to ``model`` or a module in it (a wrapper such as PEFT's)."""
    return next((m.__dict__[_ATTR] for m in model.modules() if _ATTR in m.__dict__), None)


def detach_weights(model: nn.Module) -> None:
    """Once ``prepare`` has read the weights: the model no longer refers to their source."""
    for m in model.modules():
        source = m.__dict__.pop(_ATTR, None)
        if source is not None:
            unguard(source)
            source.close()


def _refuse_before_prepare(module: nn.Module, _args: tuple[object, ...]) -> None:
    source = attached_weights(module)
    origin = source.origin if source is not None else "its source"
    fallback = source.fallback if source is not None else "build it with its values"
    raise RuntimeError(
        f"{type(module).__name__}'s weights are still in {origin}: elixir_runtime.prepare fills its chunks from "
        f"there (ElixirTrainer, ElixirAccelerator); a model used without Elixir must be built with its values: {fallback}"
    )
