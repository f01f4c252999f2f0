"""The fault-injection suite runs its own Elixir settings: an ``ELIXIR_CONFIG`` in the caller's
environment must not reach the trainers or the subprocesses."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)
