"""Every configuration value is checked before anything runs, and the error names the field, the
value, what to use instead and where the value came from (``--elixir``, ``ELIXIR_CONFIG``, a file).

Measured before these checks: ``{"chunk_size": "big"}`` failed inside prepare with ``'<' not
supported between 'str' and 'int'``; ``{"offload": true}`` with ``'bool' object is not iterable``;
``init_scale: -1`` trained with a rising loss; ``init_scale: 0`` and ``growth_interval: 0`` raised
ZeroDivisionError mid-training; ``unit_classes: ["Nope"]`` was silently ignored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import elixir_runtime as er
from elixir_hf import ElixirAccelerator, ElixirSpecError, ElixirTrainingArguments
from elixir_runtime.config import ConfigError
from helpers.models import make_batch, tiny_gpt2

# one bad value per field; the last test makes sure no field is left out
BAD_CONFIG = {
    "mode": "fast",
    "dtype": 16,
    "chunk_size": "big",
    "n_blocks": 0,
    "offload": True,
    "prefetch": 1.5,
    "unit_classes": "GPT2Block",
    "device": "gpu:0",
    "process_group": "world",
    "loss_scale": {"init_scale": 8},
    "alignment": 0,
    "cpu_threads": -2,
    "clips_grads": "yes",
    "grad_accum_steps": 0,
    "device_assisted_update": "yes",
    "lockstep_timeout_s": 0,
    "skip_nonfinite": "yes",
    "record_update_rate": "no",
    "max_consecutive_skips": 0,
    "moments": "int4",
    "activations": "cpu",
    "gpu_memory": 7.5e10,
}
BAD_LOSS_SCALE = {
    "init_scale": -1.0,
    "growth_factor": 1.0,
    "backoff_factor": 0.0,
    "growth_interval": 0,
    "min_scale": float("nan"),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELIXIR_CONFIG", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("name", sorted(BAD_CONFIG))
def test_every_elixir_config_field_is_checked(name: str) -> None:
    value = BAD_CONFIG[name]
    with pytest.raises(ConfigError, match=rf"ElixirConfig\.{name}\b.*{type(value).__name__}"):
        er.ElixirConfig(**{name: value})


@pytest.mark.parametrize("name", sorted(BAD_LOSS_SCALE))
def test_every_loss_scale_field_is_checked(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"LossScaleConfig\.{name} must be .*, got"):
        er.LossScaleConfig(**{name: BAD_LOSS_SCALE[name]})


def test_no_field_is_left_unchecked() -> None:
    assert set(BAD_CONFIG) == {f.name for f in dataclasses.fields(er.ElixirConfig)}
    assert set(BAD_LOSS_SCALE) == {f.name for f in dataclasses.fields(er.LossScaleConfig)}


def test_good_values_still_pass() -> None:
    config = er.ElixirConfig(
        chunk_size=1024,
        n_blocks="min",
        offload=[0, 2],
        prefetch=0,
        unit_classes=["GPT2Block"],
        device="cpu",
        dtype="bf16",
        lockstep_timeout_s=5,
    )
    assert config.dtype == torch.bfloat16
    assert er.ElixirConfig(offload=1).offload == 1 and er.ElixirConfig(offload=0.25).offload == 0.25
    er.LossScaleConfig(init_scale=1024, min_scale=1024, growth_interval=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_size = 0  # a checked config stays checked


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"chunk_size": "big"}, r"ElixirConfig\.chunk_size must be a positive int .*, got 'big' \(str\)"),
        ({"offload": True}, r"ElixirConfig\.offload must be a fraction .* got True \(bool\)"),
        ({"offload": [1, 1]}, r"ElixirConfig\.offload must be .*distinct chunk indices.* got \[1, 1\]"),
        ({"loss_scale": {"init_scale": -1}}, r"LossScaleConfig\.init_scale must be a positive finite number.*got -1"),
        ({"loss_scale": {"init_scale": 0}}, r"LossScaleConfig\.init_scale must be .*got 0"),
        ({"loss_scale": {"growth_interval": 0}}, r"LossScaleConfig\.growth_interval must be an int >= 1.*got 0"),
        ({"loss_scale": 8}, r"loss_scale must be an object"),
        ({"gpu_memory": "lots"}, r"ElixirConfig\.gpu_memory: not a memory size: 'lots' .*give a size such as '70GiB'"),
        ({"chunk_sise": 4096}, r"unknown .* key 'chunk_sise' \(did you mean 'chunk_size'\?\)"),
    ],
)
@pytest.mark.parametrize("source", ["--elixir", "ELIXIR_CONFIG", "file"])
def test_errors_name_the_source(tmp_path, monkeypatch, source: str, spec: dict, message: str) -> None:
    text = json.dumps(spec)
    kwargs = {"elixir": text}
    where = "--elixir"
    if source == "ELIXIR_CONFIG":
        monkeypatch.setenv("ELIXIR_CONFIG", text)
        kwargs, where = {}, "ELIXIR_CONFIG"
    elif source == "file":
        path = tmp_path / "elixir.json"
        path.write_text(text)
        kwargs, where = {"elixir": str(path)}, f"--elixir file {path}"
    with pytest.raises(ElixirSpecError, match=message) as info:
        ElixirTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)
    assert str(info.value).startswith(where) or f"unknown {where} key" in str(info.value), str(info.value)


def test_accelerator_names_its_source(monkeypatch) -> None:
    with pytest.raises(ElixirSpecError, match=r"^ElixirAccelerator\(elixir_plugin=\.\.\.\): ElixirConfig\.prefetch"):
        ElixirAccelerator(cpu=True, elixir_plugin={"prefetch": -1})
    monkeypatch.setenv("ELIXIR_CONFIG", '{"n_blocks": "some"}')
    with pytest.raises(ElixirSpecError, match=r"^ELIXIR_CONFIG: ElixirConfig\.n_blocks must be .*got 'some'"):
        ElixirAccelerator(cpu=True)


def test_unknown_unit_classes_fail_at_prepare_naming_the_model_classes(monkeypatch) -> None:
    import elixir_runtime.api as api

    def forbidden(*_a, **_k):
        raise AssertionError("prepare allocated the chunk runtime before rejecting unit_classes")

    monkeypatch.setattr(api, "ChunkRuntime", forbidden)
    model = tiny_gpt2()
    config = er.ElixirConfig(mode="static", unit_classes=["GPT2Block", "Nope"])
    with pytest.raises(ConfigError, match=r"unit_classes names \['Nope'\].*GPT2LMHeadModel.*'GPT2Block'"):
        er.prepare(model, torch.optim.AdamW(model.parameters()), config, example_batch=make_batch(64))
    assert not hasattr(model, "_elixir")


@pytest.mark.parametrize("value", ["", " ", "\t"])
def test_empty_values_are_refused_everywhere(tmp_path, monkeypatch, value: str) -> None:
    """An empty ``--elixir``/``ELIXIR_CONFIG`` (a shell variable that expanded to nothing) used to mean off."""
    from transformers import HfArgumentParser

    from elixir_hf.commands.run import main

    accepted = r"is empty \(.*\): use 'auto', 'off' \(or false/no/none/0\), a JSON object .* or the path of an existing \.json file"
    with pytest.raises(ElixirSpecError, match="^--elixir " + accepted):
        ElixirTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], elixir=value)
    with pytest.raises(ElixirSpecError, match="^--elixir " + accepted):
        HfArgumentParser(ElixirTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--elixir", value]
        )
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    for argv in (
        [str(script), "--elixir", value],
        ["--elixir", value, str(script)],
        [str(script), f"--elixir={value}"],
    ):
        with pytest.raises(SystemExit, match="^elixir-run: --elixir " + accepted):
            main(argv)
    monkeypatch.setenv("ELIXIR_CONFIG", value)
    with pytest.raises(SystemExit, match="^elixir-run: ELIXIR_CONFIG " + accepted):
        main([str(script)])
    with pytest.raises(ElixirSpecError, match="^ELIXIR_CONFIG " + accepted):
        ElixirTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ElixirSpecError, match="^ELIXIR_CONFIG " + accepted):
        ElixirAccelerator(cpu=True)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("seconds", [0.001, 0.5, 1e15])
def test_a_lockstep_timeout_that_cannot_work_is_refused_at_parse_time(seconds: float) -> None:
    """Before: 0.001 gave a false "stopped answering" verdict on a live rank, 1e15 an OverflowError."""
    spec = json.dumps({"lockstep_timeout_s": seconds})
    with pytest.raises(ElixirSpecError, match=rf"--elixir: lockstep_timeout_s is {seconds!r}: it must be 1 to 604800"):
        ElixirTrainingArguments(output_dir="out", elixir=spec, use_cpu=True)
    assert ElixirTrainingArguments(output_dir="out", elixir='{"lockstep_timeout_s": 2}', use_cpu=True).elixir_plugin


def test_a_plan_file_with_a_dtype_no_plan_is_made_for_is_refused_naming_the_file(tmp_path) -> None:
    """Before: ``"dtype": "int8"`` in a plan file passed parsing and failed later, naming no file."""
    plan = json.loads((Path(__file__).parents[1] / "elixir_hf" / "plan_files" / "saved_by_a_run.json").read_text())
    path = tmp_path / "elixir_plan.json"
    path.write_text(json.dumps({**plan, "dtype": "int8"}))
    with pytest.raises(ElixirSpecError, match=rf"--elixir file {path}: the plan's dtype is 'int8'; a plan is made for"):
        ElixirTrainingArguments(output_dir="out", elixir=str(path), use_cpu=True)
