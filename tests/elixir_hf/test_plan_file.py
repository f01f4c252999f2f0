"""A plan file is read by ``ElixirPlan.from_dict``, the one plan reader, wherever it comes from, and
renders through the plan's one renderer; a file of a format this version does not read is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elixir_hf.plugin import ElixirPlugin, ElixirSpecError
from elixir_runtime import ElixirPlan
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
    with pytest.raises(ElixirSpecError, match=rf"--elixir file {path} is not an ElixirPlan: .*'n_blokcs'"):
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
"""Plan files as a run's checkpoint (static, with its model) and ``elixir-plan --json``'s plan (searched,
on an H100) hold them, and one a run of elixir-hf 0.1.0 saved (format 1: no ``format`` key)."""


@pytest.mark.parametrize("name", ["saved_by_a_run.json", "searched.json"])
def test_plan_files_load_render_and_round_trip(name: str) -> None:
    path = FILES / name
    data = json.loads(path.read_text())
    plugin = ElixirPlugin.from_spec(str(path))
    plan = plugin.plan
    assert (list(plan.offload), plan.n_chunks, plan.chunk_size) == (
        data["offload"],
        data["n_chunks"],
        data["chunk_size"],
    )
    assert f"offloaded chunks          {len(plan.offload)} of {plan.n_chunks}" in plan_table(plan)
    assert plan_metrics(plan)["plan_offloaded_chunks"] == len(plan.offload)
    again = json.loads(plan.to_json())
    assert again["format"] == PLAN_FORMAT and ElixirPlan.from_dict(again) == plan
    assert {k: v for k, v in data.items() if k != "model"} == again  # written as it was read


def test_a_searched_plan_file_is_typed() -> None:
    plan = ElixirPlan.from_json(FILES / "searched.json")
    report = plan.search
    assert report.rates.cpu_update_Gps > 0 and report.hardware.device == "NVIDIA H100 80GB HBM3"
    assert report.hardware.attention == {"1024": pytest.approx(192.7e12, rel=1e-3)}  # version 3: one rate, by length
    assert [c.chunk_size for c in report.candidates if c.chunk_size == plan.chunk_size] == [plan.chunk_size]
    assert [a.name for a in plan.alternatives] == ["zero2-offload-all", "zero3-offload-all", "rcache-max", "rcache-min"]
    assert "<- chosen" in candidates_table(plan) and "zero3-offload-all" in alternatives_table(plan)
    assert plan_metrics(plan)["plan_step_s"] == plan.predicted.total


def test_a_plan_file_of_format_1_is_refused_naming_the_file_and_the_release_that_reads_it() -> None:
    path = FILES / "saved_by_a_run_format1.json"
    with pytest.raises(
        ValueError, match=rf"plan file {path} is of plan format 1 .*elixir-hf 0.2.0 reads both.*elixir-plan"
    ):
        ElixirPlan.from_json(path)
    with pytest.raises(
        ElixirSpecError, match=rf"--elixir file {path} is of plan format 1 .*elixir-hf 0.2.0 reads both"
    ):
        ElixirPlugin.from_spec(str(path))


def test_a_plan_is_frozen_and_a_newer_format_is_refused(tmp_path) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLAN.n_blocks = 4
    assert dataclasses.replace(PLAN, n_blocks=4).n_blocks == 4 and PLAN.n_blocks == 3
    path = tmp_path / "elixir_plan.json"
    path.write_text(json.dumps({**json.loads(PLAN.to_json()), "format": PLAN_FORMAT + 1}))
    with pytest.raises(
        ElixirSpecError, match=f"{path} is of plan format {PLAN_FORMAT + 1}, not one this elixir-hf reads"
    ):
        ElixirPlugin.from_spec(str(path))
