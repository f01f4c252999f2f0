"""Capturing one logger's records with pytest's ``caplog``, wherever its tree propagates.

``elixir_hf`` hangs the ``elixir_runtime`` and ``elixir_hf`` trees under transformers' root logger,
which does not propagate to the root logger where ``caplog`` listens: ``captured`` puts caplog's
handler on the logger itself (and stops its propagation meanwhile, so a record is caught once
whether or not elixir_hf was imported in this process).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest


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
