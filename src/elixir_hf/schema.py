"""The JSON Schema of an ``--elixir`` value, generated from the classes that parse it.

    python -m elixir_hf.schema > elixir.schema.json

The keys are ``ElixirConfig.settings()`` and ``plugin.PLUGIN_KEYS`` (``ElixirPlugin.from_spec``'s), each
typed from its field's annotation (``loss_scale``: ``LossScaleConfig``'s fields) and described by the
docstring under the field; a JSON object with any other key does not validate. A value's range (an
``offload`` fraction in [0, 1]) is the classes' own check, made when the value is parsed. The schema
also takes what the grammar takes besides an object: a word (``auto``, ``off``), a ``.json`` path, and
YAML's booleans (the ``elixir`` key of a YAML config). ``docs/elixir.schema.json`` is this output,
checked by ``tests/elixir_hf/test_schema.py``.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import types
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Literal, Union, get_args, get_origin, get_type_hints

from elixir_runtime.config import ElixirConfig

from .plugin import ACCEPTED, PLUGIN_KEYS, ElixirPlugin

__all__ = ["elixir_schema", "main"]

_SCALARS: dict[object, dict[str, object]] = {
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    type(None): {"type": "null"},
}


def elixir_schema() -> dict[str, object]:
    """The schema (draft 2020-12) of what ``ElixirPlugin.from_spec`` accepts."""
    keys = {name: _field(ElixirConfig, name) for name in ElixirConfig.settings()}
    keys.update({name: _field(ElixirPlugin, name) for name in PLUGIN_KEYS})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "--elixir",
        "description": f"The value of --elixir, ELIXIR_CONFIG or a config file's elixir key: {ACCEPTED}.",
        "anyOf": [
            {"type": "string", "description": "auto, off (or false/no/none/0), or the path of a .json file"},
            {"type": "boolean", "description": "YAML's true (auto) or false (off)"},
            {"$ref": "#/$defs/settings"},
        ],
        "$defs": {"settings": _object(keys, "the run's settings: ElixirConfig fields and the plugin's own")},
    }


def _object(properties: Mapping[str, object], description: str) -> dict[str, object]:
    return {"type": "object", "description": description, "properties": properties, "additionalProperties": False}


def _field(cls: type, name: str) -> dict[str, object]:
    hint = get_type_hints(cls)[name]
    if is_dataclass(hint):
        assert isinstance(hint, type)
        sub = {f.name: _field(hint, f.name) for f in fields(hint)}
        schema = _object(sub, f"{hint.__name__} fields")
    else:
        typed = _type(hint)
        assert typed is not None, f"{cls.__name__}.{name}: no JSON type for {hint}"
        schema = typed
    default = next(f.default for f in fields(cls) if f.name == name)
    if isinstance(default, (bool, int, float, str, type(None))):  # not MISSING nor a factory's
        schema["default"] = default
    doc = _docstrings(cls).get(name)
    if doc:
        schema["description"] = doc
    return schema


def _type(hint: object) -> dict[str, object] | None:
    """``hint`` as a JSON Schema; ``None`` for what JSON cannot hold (a ``torch.dtype``, a class)."""
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin = get_origin(hint)
    if origin is Literal:
        return {"enum": list(get_args(hint))}
    if origin in (Union, types.UnionType):
        parts = [s for s in map(_type, get_args(hint)) if s is not None]
        return parts[0] if len(parts) == 1 else {"anyOf": parts} if parts else None
    if origin in (list, tuple, Sequence):
        items = _type(get_args(hint)[0])
        return None if items is None else {"type": "array", "items": items}
    return None


def _docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under its line in the class body), one line of text."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    out = {}
    for line, after in zip(body.body, body.body[1:]):
        if (
            isinstance(line, ast.AnnAssign)
            and isinstance(line.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[line.target.id] = " ".join(after.value.value.split())
    return out


def main() -> None:
    json.dump(elixir_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
