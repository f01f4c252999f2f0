"""The ``elixir`` key of a YAML config file (TRL's ``--config``, the SFT recipe's), as a spec.

Only the standard library at import (``elixir-run --help`` loads nothing); PyYAML when a file is read.
"""

from __future__ import annotations

import json

__all__ = ["elixir_key", "spec_of"]


def spec_of(value: object) -> str:
    """A YAML value as the spec string ``ElixirPlugin.from_spec`` reads: a mapping (or a list, which it
    refuses) as JSON, YAML's booleans (``off``/``no``/``false`` read as false) as ``auto``/``off``."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def elixir_key(path: str) -> tuple[str, str] | None:
    """``(source, spec)`` of the file's ``elixir`` key, the source naming the key and the file (every
    refusal of the value says it); ``None`` without the key (or null), or for a file that does not read
    as a YAML mapping (its reader, TRL's parser, says what is wrong with it)."""
    try:
        import yaml  # type: ignore[import-untyped]  # PyYAML ships no types (transformers installs it)
    except ImportError:  # no TRL (which reads the file through it) either
        return None
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(config, dict) or config.get("elixir") is None:
        return None
    return f"{path}'s elixir", spec_of(config["elixir"])
