"""The ``--elixir`` keys as docs/hf.md's table names them, each with a value it takes alone.

One reading of the table for every parser that must accept its keys: the run's (``ElixirPlugin``,
``tests/elixir_hf/test_errors.py``) and ``elixir-plan --elixir``'s (``tests/elixir_hf/commands/test_plan.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from elixir_hf.plugin import ElixirPlugin
from elixir_runtime import ElixirConfig

_SPECIAL = {"record_update_rate": False, "grad_accum_steps": None, "loss_scale": {}, "lean_loss": False}
"""``record_update_rate: false``, the documented off switch (once refused by a hand-copied key list);
objects as JSON takes them."""


def documented_keys() -> list[str]:
    """The keys of docs/hf.md's "The JSON keys" table, in its order."""
    docs = (Path(__file__).parents[2] / "docs" / "hf.md").read_text()
    table = docs.split("### The JSON keys", 1)[1].split("\n\n| key |", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", table, flags=re.M)


def documented_value(key: str) -> Any:
    """A value ``key`` takes alone: its default (JSON's spelling of it)."""
    return _SPECIAL.get(key, getattr(ElixirConfig(), key, getattr(ElixirPlugin(), key, None)))
