"""The JSON Schema of ``--elixir`` (``elixir_hf.schema``): generated from ``ElixirConfig`` and the plugin's
keys, it takes what ``ElixirPlugin.from_spec`` takes and refuses what it refuses, key by key; the docs'
copy is its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elixir_hf.plugin import PLUGIN_KEYS, ElixirPlugin, ElixirSpecError
from elixir_hf.schema import elixir_schema
from elixir_runtime import ElixirConfig

DOCS_COPY = Path(__file__).parents[2] / "docs" / "elixir.schema.json"

EXAMPLES: dict[str, Any] = {
    "mode": "static",
    "chunk_size": 1 << 20,
    "n_blocks": "min",
    "offload": [0, 2],
    "unit_classes": ["GPT2Block"],
    "gpu_memory": "70GiB",
    "activations": "host",
    "device_assisted_update": "auto",
    "prefetch": 2,
    "cpu_threads": 4,
    "lockstep_timeout_s": 30,
    "record_update_rate": False,
    "dtype": "bf16",
    "moments": "8bit",
    "loss_scale": {"init_scale": 1024.0, "growth_interval": 100},
    "skip_nonfinite": False,
    "max_consecutive_skips": 5,
    "lean_loss": False,
    "allow_missing_adam_state": True,
    "preempt_grace_s": 10.5,
    "reference_offload": 0.5,
}
"""A value of each key that ``from_spec`` accepts (a new key fails below until it has one)."""

WRONG_TYPES: dict[str, Any] = {
    "offload": "half",
    "n_blocks": "most",
    "moments": "4bit",
    "lean_loss": "yes",
    "loss_scale": {"init_scale": "big"},
    "prefetch": 1.5,
}


def _valid(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """The draft 2020-12 keywords the generated schema uses: $ref, anyOf, enum, type, properties,
    additionalProperties, items (JSON's types: a boolean is no integer, an integer is a number)."""
    if "$ref" in schema:
        return _valid(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in schema:
        return any(_valid(value, s, root) for s in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}
    kind = schema["type"]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "object":
        props = schema["properties"]
        return isinstance(value, dict) and all(k in props and _valid(v, props[k], root) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and all(_valid(v, schema["items"], root) for v in value)
    return {
        "boolean": isinstance(value, bool),
        "integer": is_number and float(value).is_integer(),
        "number": is_number,
        "string": isinstance(value, str),
        "null": value is None,
    }[kind]


def _schema_takes(value: Any) -> bool:
    schema = elixir_schema()
    return _valid(value, schema, schema)


def test_the_keys_are_the_configs_and_the_plugins() -> None:
    keys = elixir_schema()["$defs"]["settings"]["properties"]
    assert list(keys) == [*ElixirConfig.settings(), *PLUGIN_KEYS]
    assert set(keys["loss_scale"]["properties"]) == {"init_scale", "growth_factor", "backoff_factor",
                                                     "growth_interval", "min_scale"}  # fmt: skip
    assert keys["offload"]["description"].startswith("Chunks whose shard and optimizer state live in pinned host")
    assert keys["mode"]["default"] == "auto" and keys["moments"]["enum"] == ["fp32", "8bit"]


@pytest.mark.parametrize("key", [*ElixirConfig.settings(), *PLUGIN_KEYS])
def test_every_key_validates_as_from_spec_takes_it(key: str) -> None:
    value = {key: EXAMPLES[key]}
    assert ElixirPlugin.from_spec(json.dumps(value)) is not None
    assert _schema_takes(value)


def test_the_words_and_a_whole_config_validate() -> None:
    for value in ("auto", "off", "plan.json", True, False, EXAMPLES):
        assert _schema_takes(value)


@pytest.mark.parametrize("value", [{"ofload": 0.5}, {"offload": 0.5, "device": "cuda:0"}, {"loss_scale": {"scale": 2}}])
def test_an_unknown_key_is_refused_by_both(value: dict[str, Any]) -> None:
    assert not _schema_takes(value)
    with pytest.raises(ElixirSpecError, match="unknown"):
        ElixirPlugin.from_spec(json.dumps(value))


@pytest.mark.parametrize(("key", "wrong"), WRONG_TYPES.items())
def test_a_value_of_the_wrong_type_is_refused_by_both(key: str, wrong: Any) -> None:
    assert not _schema_takes({key: wrong})
    with pytest.raises(ElixirSpecError, match=key if key != "loss_scale" else "init_scale"):
        ElixirPlugin.from_spec(json.dumps({key: wrong}))


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_the_docs_copy_is_the_generated_schema() -> None:
    out = subprocess.run([sys.executable, "-m", "elixir_hf.schema"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == elixir_schema()
    assert DOCS_COPY.read_text() == out.stdout, "regenerate it: python -m elixir_hf.schema > docs/elixir.schema.json"
