"""Elixir versions of classes the user did not write: a ``Trainer``, ``TrainingArguments`` or
``Accelerator`` subclass (TRL's ``SFTTrainer``/``SFTConfig``) made Elixir, and ``elixir-run``'s
switch that makes every such class build its Elixir version.

The order is the subclass first, the Elixir class after it (``class X(SFTConfig,
ElixirTrainingArguments)``): the subclass's defaults and overrides win, and reach Elixir's through
``super()``. The other order would give the subclass's fields ``TrainingArguments``' defaults
(``SFTConfig``'s learning_rate 2e-5 would read 5e-5), since a dataclass takes each field's default
from the last class in the reversed MRO that declares it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["mixed_class", "construct_elixir"]


def mixed_class(cls: type, elixir: type, namespace: dict[str, Any] | None = None) -> type:
    """``class Elixir<cls>(cls, elixir)``; ``cls`` itself if it already is Elixir, ``elixir`` if
    ``cls`` is the stock class ``elixir`` extends."""
    if issubclass(cls, elixir):
        return cls
    if issubclass(elixir, cls):
        return elixir
    name = f"Elixir{cls.__name__}"
    return type(name, (cls, elixir), {"__module__": elixir.__module__, "__qualname__": name, **(namespace or {})})


def construct_elixir(stock: type, elixir_of: Callable[[type], type]) -> None:
    """From now on, ``stock(...)`` and ``Sub(...)`` for every subclass ``Sub`` (defined before or
    after) build an instance of ``elixir_of(Sub)``. ``isinstance(x, Sub)`` stays true; Python calls
    that class's ``__init__`` with the caller's arguments, as it would have called ``Sub``'s."""
    if getattr(stock.__new__, "_elixir", False):
        return

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(elixir_of(cls))

    __new__._elixir = True  # type: ignore[attr-defined]
    stock.__new__ = staticmethod(__new__)  # type: ignore[method-assign]
