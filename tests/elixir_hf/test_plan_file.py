"""A plan file is read by ``ElixirPlan.from_dict``, the one plan reader, wherever it comes from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elixir_hf.plugin import ElixirPlugin, ElixirSpecError
from elixir_runtime import ElixirPlan

PLAN = ElixirPlan(
    chunk_size=4096, n_blocks=3, offload=[2], n_chunks=4, world_size=1, dtype="float32", min_blocks=2, max_blocks=4
)


def test_a_saved_plan_round_trips_and_pins_the_layout(tmp_path) -> None:
    path = tmp_path / "elixir_plan.json"
    path.write_text(PLAN.to_json())
    assert ElixirPlan.from_json(path) == PLAN
    plugin = ElixirPlugin.from_spec(str(path))
    assert (plugin.config.mode, plugin.config.chunk_size, plugin.config.n_blocks, plugin.config.offload) == (
        "static",
        4096,
        3,
        [2],
    )


def test_a_plan_with_an_unknown_key_names_it(tmp_path) -> None:
    path = tmp_path / "elixir_plan.json"
    path.write_text(json.dumps({**json.loads(PLAN.to_json()), "n_blokcs": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['n_blokcs'\]"):
        ElixirPlan.from_json(path)
    with pytest.raises(ElixirSpecError, match=r"looks like a plan but is not one: .*'n_blokcs'"):
        ElixirPlugin.from_spec(str(path))


def test_the_gpu_memory_cap_is_recorded_and_held_again(tmp_path) -> None:
    """A plan made under ``ElixirConfig.gpu_memory`` records it, and a run from the file is held to it;
    plans from before the field have none."""
    path = tmp_path / "elixir_plan.json"
    capped = dataclasses.replace(PLAN, gpu_memory=40 * 2**30)
    path.write_text(capped.to_json())
    assert json.loads(path.read_text())["gpu_memory"] == 40 * 2**30
    assert ElixirPlugin.from_spec(str(path)).config.gpu_memory == 40 * 2**30
    old = {k: v for k, v in json.loads(PLAN.to_json()).items() if k != "gpu_memory"}
    path.write_text(json.dumps(old))
    assert ElixirPlugin.from_spec(str(path)).config.gpu_memory is None
