"""The names ``elixir-plan``'s help lists, without importing the engine (torch): the shipped cards
(``elixir_runtime.hardware.SHIPPED``), the measured one (``REFERENCE``) and the moments' storage words
(``elixir_runtime.MOMENTS``). tests/elixir_hf/commands/test_console_scripts.py checks they are the
engine's."""

from __future__ import annotations

__all__ = ["CARDS", "REFERENCE", "MOMENTS"]

CARDS = ("a100-40gb", "a100-80gb", "h100", "h200", "l40s", "rtx4090")
REFERENCE = "h100"
MOMENTS = ("fp32", "8bit")
