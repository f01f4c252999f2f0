"""Progress of the engine's long steps, shown by whoever installs a bar factory; nothing by default.

The engine imports only torch, so it draws no bars itself. Around each long step (filling the chunk
shards, profiling and searching a plan, measuring the hardware, gathering the weights of a state
dict) it asks ``progress(total, desc)`` for a bar and calls ``update(n)`` on it. Without a factory
that bar does nothing. A caller that wants bars (``elixir_hf``: tqdm on the rank that shows them)
installs a factory with ``set_progress_factory``; which processes show bars is the factory's
decision, made where it is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

__all__ = ["Bar", "BarFactory", "progress", "set_progress_factory", "track"]

T = TypeVar("T")


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> object: ...


BarFactory = Callable[..., Bar]
"""Called as ``factory(total=..., desc=..., unit=...)`` (tqdm's keywords; ``total`` may be None:
unknown; ``unit`` ``"B"`` counts bytes)."""


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


_factory: BarFactory | None = None


def set_progress_factory(factory: BarFactory | None) -> BarFactory | None:
    """Every later bar of this process comes from ``factory`` (None: no bars); returns the one replaced."""
    global _factory
    previous, _factory = _factory, factory
    return previous


@contextlib.contextmanager
def progress(total: int | None, desc: str, unit: str = "it") -> Iterator[Bar]:
    """A bar for ``total`` steps (or bytes, ``unit="B"``), closed on exit; none for nothing to do (0)."""
    bar = _factory(total=total, desc=desc, unit=unit) if _factory is not None and total != 0 else _NoBar()
    try:
        yield bar
    finally:
        bar.close()


def track(items: Iterable[T], desc: str, unit: str = "it") -> Iterator[T]:
    """``items``, one bar step each (of ``len(items)`` where it has one)."""
    total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    with progress(total, desc, unit) as bar:
        for item in items:
            yield item
            bar.update()
