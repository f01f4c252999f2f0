"""A plan file is read by ``ElixirPlan.from_dict``, the one plan reader, wherever it comes from; the
files of earlier versions still load, and render through the plan's one renderer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elixir_hf.plugin import ElixirPlugin, ElixirSpecError
from elixir_runtime import ElixirPlan
from elixir_runtime.hardware import HardwareProfile
from elixir_runtime.plan import PLAN_FORMAT
from elixir_runtime.plan_view import alternatives_table, candidates_table, plan_metrics, plan_table

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
    assert plugin.config.device_assisted_update is False and plugin.plan == PLAN


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


FILES = Path(__file__).parent / "plan_files"
"""Plan files as the versions before the typed plan wrote them (format 1: no ``format`` key): a
run's checkpoint (static, with its model) and ``elixir-plan --json``'s plan (searched)."""


@pytest.mark.parametrize("name", ["saved_by_a_run_format1.json", "searched_format1.json"])
def test_files_of_format_1_load_render_and_round_trip(name: str) -> None:
    path = FILES / name
    data = json.loads(path.read_text())
    plugin = ElixirPlugin.from_spec(str(path))
    plan = plugin.plan
    assert (list(plan.offload), plan.n_chunks, plan.chunk_size) == (
        data["offload"],
        data["n_chunks"],
        data["chunk_size"],
    )
    assert (plan.profile, plan.chunks) == (None, ())  # not in format 1: rendered without them
    assert f"offloaded chunks          {len(plan.offload)} of {plan.n_chunks}" in plan_table(plan)
    assert plan_metrics(plan)["plan_offloaded_chunks"] == len(plan.offload)
    again = json.loads(plan.to_json())
    assert again["format"] == PLAN_FORMAT and ElixirPlan.from_dict(again) == plan
    for key, value in data.items():  # the keys format 1 had are written as they were read
        if key == "search" and value:  # but its hardware profile in the current layout (one attention rate: by length)
            value = {**value, "hardware": HardwareProfile.from_dict(value["hardware"]).to_dict()}
            assert again[key]["hardware"]["attention"] == {"1024": data[key]["hardware"]["attention"]}
        if key not in ("model", "predicted_step_s"):
            assert again[key] == value, key


def test_a_searched_file_of_format_1_is_typed() -> None:
    plan = ElixirPlan.from_json(FILES / "searched_format1.json")
    report = plan.search
    assert report.rates.cpu_update_Gps > 0 and report.hardware.device == "NVIDIA H100 80GB HBM3"
    assert [c.chunk_size for c in report.candidates if c.chunk_size == plan.chunk_size] == [plan.chunk_size]
    assert [a.name for a in plan.alternatives] == ["zero2-offload-all", "zero3-offload-all", "rcache-max", "rcache-min"]
    assert "<- chosen" in candidates_table(plan) and "zero3-offload-all" in alternatives_table(plan)
    assert plan_metrics(plan)["plan_step_s"] == plan.predicted.total


def test_a_plan_is_frozen_and_a_newer_format_is_refused(tmp_path) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLAN.n_blocks = 4
    assert dataclasses.replace(PLAN, n_blocks=4).n_blocks == 4 and PLAN.n_blocks == 3
    path = tmp_path / "elixir_plan.json"
    path.write_text(json.dumps({**json.loads(PLAN.to_json()), "format": PLAN_FORMAT + 1}))
    with pytest.raises(ElixirSpecError, match=f"plan format {PLAN_FORMAT + 1} is not one this version reads"):
        ElixirPlugin.from_spec(str(path))
