"""The fault-injection suite runs its own Elixir settings: an ``ELIXIR_CONFIG`` in the caller's
environment must not reach the trainers or the subprocesses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the HF cases (hf_cases.py) these tests and their workers share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "elixir_hf"))


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)
