"""The sizes ``elixir-plan`` takes (``--gpu-mem``, ``--gpu-memory``, ``--host-mem``): torch-free, for the parser
and ``hardware.py`` alike."""

from __future__ import annotations

import argparse

__all__ = ["parse_size"]


def parse_size(text: str) -> int:
    """``80GiB``, ``80G`` (binary), ``80GB`` (decimal), ``512MiB``; a bare number is GiB
    (``elixir_runtime.config.parse_size``, the rule of ``ElixirConfig.gpu_memory`` too); at least its
    ``MIN_SIZE`` (1 MiB): ``0`` was planned as the card's own size, and a host of 0 bytes as no limit."""
    from elixir_runtime.config import MIN_SIZE
    from elixir_runtime.config import parse_size as config_parse_size

    try:
        size = config_parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"must be at least 1 MiB, got {text!r} ({size} bytes)")
    return size
