"""Bad input fails before training with a message that names the fix; the ``--elixir`` grammar
parses as documented from the command line and from ``ELIXIR_CONFIG``."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, make_trainer, training_args
from transformers import HfArgumentParser

from elixir_hf import ElixirAccelerator, ElixirPlugin, ElixirSpecError, ElixirTrainingArguments
from elixir_hf.plugin import PLUGIN_KEYS
from elixir_runtime import ElixirConfig
from helpers.models import tiny_gpt2
from helpers.spec_keys import documented_keys, documented_value


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELIXIR_CONFIG", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)


def _args(tmp_path, elixir, **kw):
    return ElixirTrainingArguments(output_dir=str(tmp_path), elixir=elixir, use_cpu=True, report_to=[], **kw)


# --------------------------------------------------------------------------- the grammar


def _parse(argv: list[str]) -> ElixirTrainingArguments:
    (args,) = HfArgumentParser(ElixirTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "x", "--use_cpu", "--report_to", "none", *argv]
    )
    return args


def test_cli_grammar(tmp_path, monkeypatch) -> None:
    assert _parse(["--elixir", "auto"]).elixir_plugin == ElixirPlugin()
    assert _parse(["--elixir"]).elixir_plugin == ElixirPlugin()  # a bare flag means auto
    assert _parse(["--elixir", "off"]).elixir_plugin is None
    assert _parse([]).elixir_plugin is None
    assert _parse(["--elixir", '{"offload": 0.5, "n_blocks": "min"}']).elixir_plugin.config.offload == 0.5
    assert _parse(["--elixir", '{"gpu_memory": "40GiB"}']).elixir_plugin.config.gpu_memory == 40 * 2**30
    settings = tmp_path / "elixir.json"
    settings.write_text(json.dumps({"chunk_size": 4096, "prefetch": 2, "cpu_threads": 6}))
    plugin = _parse(["--elixir", str(settings)]).elixir_plugin
    assert (plugin.config.chunk_size, plugin.config.prefetch, plugin.config.cpu_threads) == (4096, 2, 6)
    assert plugin.config.cpu_threads == 6
    monkeypatch.setenv("ELIXIR_CONFIG", '{"offload": 0.25, "gpu_memory": 70000000000}')
    assert (_parse([]).elixir_plugin.config.offload, _parse([]).elixir_plugin.config.gpu_memory) == (0.25, 7 * 10**10)
    assert _parse(["--elixir", "off"]).elixir_plugin is None  # the flag wins over the environment


def test_the_plugin_is_no_argument(tmp_path) -> None:
    """``elixir_plugin`` comes from ``--elixir``: no flag of its own, and not in ``to_dict`` (TensorBoard and W&B
    write the arguments as JSON as training begins; an ElixirPlugin in them failed there)."""
    args = _args(tmp_path, "auto")
    assert args.elixir_plugin == ElixirPlugin() and "elixir_plugin" not in args.to_dict()
    assert json.loads(args.to_json_string())["elixir"] == "auto"
    with pytest.raises(ValueError, match="elixir_plugin"):
        _parse(["--elixir_plugin", "auto"])


def test_every_key_the_docs_name_is_accepted_and_every_setting_is_named(tmp_path) -> None:
    """docs/hf.md's key table and ``ElixirConfig.settings()`` (+ the plugin's ``PLUGIN_KEYS``) are the same
    keys; each one alone, at its documented default, parses (``record_update_rate: false``, the
    documented off switch, was once refused by a hand-copied key list)."""
    keys = documented_keys()
    assert sorted(keys) == sorted([*ElixirConfig.settings(), *PLUGIN_KEYS])
    for key in keys:
        spec = json.dumps({key: documented_value(key)}, default=str)
        assert _args(tmp_path, spec).elixir_plugin is not None, key
    for run_key in ("device", "process_group", "alignment", "clips_grads", "grad_accum_steps"):
        with pytest.raises(ElixirSpecError, match=f"unknown --elixir key '{run_key}'"):
            _args(tmp_path, json.dumps({run_key: 1}))


@pytest.mark.parametrize("word", ["off", "Off", "OFF", "false", "False", "no", "NO", "none", "None", "0", " off "])
def test_every_spelling_of_off_is_off(tmp_path, monkeypatch, word: str) -> None:
    """On the command line, in the arguments and in ``ELIXIR_CONFIG``; ``Auto`` is auto."""
    monkeypatch.setenv("ELIXIR_CONFIG", "auto")
    assert _parse(["--elixir", word]).elixir_plugin is None
    assert _args(tmp_path, word).elixir_plugin is None
    monkeypatch.setenv("ELIXIR_CONFIG", word)
    assert _parse([]).elixir_plugin is None
    assert _parse(["--elixir", "Auto"]).elixir_plugin == ElixirPlugin()


def test_precision_goes_to_the_engine(tmp_path, monkeypatch) -> None:
    args = _args(tmp_path, "auto", fp16=True)
    assert (args.elixir_plugin.config.dtype, args.mixed_precision) == (torch.float16, "no")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from the yaml
    args = _args(tmp_path, "auto")
    assert (args.elixir_plugin.config.dtype, args.mixed_precision) == (torch.bfloat16, "no")


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "spec, message",
    [
        ("aut", "'aut' is not understood: use 'auto', 'off' \\(or false/no/none/0\\), a JSON object"),
        ("yes", "--elixir 'yes' is not understood"),
        ("missing.json", "'missing.json' is not understood"),
        ('{"ofload": 0.5}', "unknown --elixir key 'ofload' \\(did you mean 'offload'\\?\\)"),
        ('{"loss_scale": {"init": 8}}', "--elixir: unknown loss_scale key"),
        ('{"offload": 2}', "--elixir: ElixirConfig.offload must be a fraction of the chunks in \\[0, 1\\]"),
        ('{"mode": "fast"}', "ElixirConfig.mode must be 'auto'"),
        (
            '{"gpu_memory": 80}',
            "--elixir: ElixirConfig.gpu_memory must be at least 1 MiB, got 80 bytes; give a size such as '70GiB'",
        ),
        ('{"gpu_memory": "80 GiBs"}', "--elixir: ElixirConfig.gpu_memory: not a memory size: '80 GiBs'"),
        ('{"offload": 0.5', "not valid JSON"),
        ('{"dtype": "bf16"}', "asks for dtype 'bf16' but mixed precision is 'fp16'"),
    ],
)
def test_bad_elixir_values(tmp_path, spec: str, message: str) -> None:
    with pytest.raises(ElixirSpecError, match=message):
        _args(tmp_path, spec, fp16=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"deepspeed": "ds_config.json"}, "cannot be combined with DeepSpeed"),
        ({"fsdp": "full_shard"}, "cannot be combined with FSDP"),
        ({"optim": "sgd"}, "--optim sgd is not supported with Elixir.*--optim adamw_torch"),
        ({"optim": "adafactor"}, "--optim adafactor is not supported"),
        ({"torch_compile_mode": "reduce-overhead"}, "--torch_compile_mode.*uses CUDA graphs"),
        ({"torch_compile_backend": "cudagraphs"}, "backend='cudagraphs' cannot work with Elixir"),
        ({"bf16_full_eval": True}, "bf16_full_eval"),
    ],
)
def test_incompatible_training_arguments(tmp_path, kwargs: dict, message: str) -> None:
    with pytest.raises(ElixirSpecError, match=message):
        _args(tmp_path, "auto", **kwargs)
    _args(tmp_path, "off", **{k: v for k, v in kwargs.items() if k in ("optim", "bf16_full_eval")})  # fine without


def test_deepspeed_from_the_launcher_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ElixirSpecError, match="cannot be combined with DeepSpeed"):
        _args(tmp_path, "auto")


# --------------------------------------------------------------------------- plan files


def _saved_plan(tmp_path) -> dict:
    trainer = make_trainer(
        "gpt2",
        training_args(
            str(tmp_path / "run"), OFFLOAD_PLAN, max_steps=1, save_strategy="steps", save_steps=1, eval_strategy="no"
        ),
    )
    trainer.train()
    return json.loads((tmp_path / "run" / "checkpoint-1" / "elixir_plan.json").read_text())


def test_plan_file_round_trip_and_mismatches(tmp_path) -> None:
    plan = _saved_plan(tmp_path)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))

    # the same model follows the saved plan exactly
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "again"), str(path), max_steps=1, eval_strategy="no"))
    trainer.train()
    assert list(trainer.model._elixir.plan.offload) == plan["offload"]

    # another model: refused before the engine is built
    trainer = make_trainer("llama", training_args(str(tmp_path / "llama"), str(path), max_steps=1, eval_strategy="no"))
    with pytest.raises(ElixirSpecError, match="made for another model"):
        trainer.train()
    assert not hasattr(trainer.model, "_elixir")

    # a plan without the model record (e.g. from the planner) is checked against the layout instead
    bare = {k: v for k, v in plan.items() if k != "model"}
    path.write_text(json.dumps({**bare, "n_chunks": bare["n_chunks"] + 1, "offload": [0]}))
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "bare"), str(path), max_steps=1, eval_strategy="no"))
    with pytest.raises(ElixirSpecError, match="does not fit this model"):
        trainer.train()
    assert not hasattr(trainer.model, "_elixir")  # refused before the engine allocated anything

    # another world size: refused at argument parsing
    path.write_text(json.dumps({**plan, "world_size": 2}))
    with pytest.raises(ElixirSpecError, match=r"made for 2 rank\(s\) but this run has 1"):
        _args(tmp_path, str(path))


# --------------------------------------------------------------------------- plain Accelerate


def test_accelerator_needs_model_and_optimizer_together() -> None:
    accelerator = ElixirAccelerator(elixir_plugin="auto", cpu=True)
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="model and its optimizer .* in the same\\s+prepare\\(\\) call"):
        accelerator.prepare(model)
    with pytest.raises(TypeError, match="Elixir runs Adam or AdamW"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ElixirSpecError, match=r"unknown ElixirAccelerator\(elixir_plugin=\.\.\.\) key .chunks."):
        ElixirAccelerator(elixir_plugin={"chunks": 3}, cpu=True)
