"""Log records and progress bars in tests.

``captured``: one logger's records in pytest's ``caplog``, wherever its tree propagates.

``elixir_hf`` hangs the ``elixir_runtime`` and ``elixir_hf`` trees under transformers' root logger,
which does not propagate to the root logger where ``caplog`` listens: ``captured`` puts caplog's
handler on the logger itself (and stops its propagation meanwhile, so a record is caught once
whether or not elixir_hf was imported in this process).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from elixir_runtime.progress import set_progress_factory


@contextlib.contextmanager
def captured(caplog: pytest.LogCaptureFixture, level: int, name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    logger.propagate = False
    try:
        with caplog.at_level(level, logger=name):
            yield
    finally:
        logger.propagate = propagate
        logger.removeHandler(caplog.handler)


@dataclass
class RecordedBar:
    total: int | None
    desc: str
    unit: str
    n: int = 0
    closed: bool = False

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def recorded_bars() -> Iterator[list[RecordedBar]]:
    """Every ``elixir_runtime.progress`` bar opened inside, in order."""
    bars: list[RecordedBar] = []

    def factory(total: int | None, desc: str, unit: str) -> RecordedBar:
        bars.append(RecordedBar(total, desc, unit))
        return bars[-1]

    previous = set_progress_factory(factory)
    try:
        yield bars
    finally:
        set_progress_factory(previous)
