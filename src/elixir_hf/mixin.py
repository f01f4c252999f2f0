"""Elixir versions of classes the user did not write: a ``Trainer``, ``TrainingArguments`` or
``Accelerator`` subclass (TRL's ``SFTTrainer``/``SFTConfig``) made Elixir (``elixir-run`` builds
them in place of the script's: ``patches.construct_elixir``).

The order is the subclass first, the Elixir class after it (``class X(SFTConfig,
ElixirTrainingArguments)``): the subclass's defaults and overrides win, and reach Elixir's through
``super()``. The other order would give the subclass's fields ``TrainingArguments``' defaults
(``SFTConfig``'s learning_rate 2e-5 would read 5e-5), since a dataclass takes each field's default
from the last class in the reversed MRO that declares it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, cast

__all__ = ["mixed_class"]

_E = TypeVar("_E")


def mixed_class(cls: type, elixir: type[_E], namespace: Mapping[str, object] | None = None) -> type[_E]:
    """``class Elixir<cls>(cls, elixir)``; ``cls`` itself if it already is Elixir, ``elixir`` if
    ``cls`` is the stock class ``elixir`` extends."""
    if issubclass(cls, elixir):
        return cls
    if issubclass(elixir, cls):
        return elixir
    name = f"Elixir{cls.__name__}"
    made = type(name, (cls, elixir), {"__module__": elixir.__module__, "__qualname__": name, **(namespace or {})})
    return cast(type[_E], made)
