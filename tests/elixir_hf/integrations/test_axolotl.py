"""The Axolotl plugin (``elixir_hf.integrations.axolotl``) through the hooks Axolotl calls, in the order its
trainer builder calls them: the config's ``elixir`` key checked naming the file, the training arguments
given the field by the mixin, the Trainer class from ``get_trainer_cls``, which trains on the engine.

Axolotl itself cannot be installed beside the transformers elixir-hf supports (docs/hf.md, "Axolotl"):
the last test loads the plugin through Axolotl's own ``PluginManager`` and config merging where Axolotl
is importable (``pip install --no-deps --target DIR axolotl==0.19.0 addict``, then ``PYTHONPATH=DIR``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

import pytest

pytest.importorskip("pydantic", reason="the axolotl extra (Axolotl brings it): pip install 'elixir-hf[axolotl]'")

from hf_cases import OFFLOAD_PLAN, history, training_args  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from transformers import Trainer, TrainingArguments, default_data_collator

from elixir_hf import ElixirTrainer
from elixir_hf.integrations.axolotl import CONFLICTS, ElixirAxolotlPlugin
from elixir_hf.plugin import ElixirSpecError
from helpers.models import MODEL_BUILDERS

PLUGIN = "elixir_hf.integrations.axolotl.ElixirAxolotlPlugin"


def _cfg(**keys: object) -> dict[str, object]:
    """An Axolotl config as ``register`` sees it (``load_cfg`` sets ``axolotl_config_path``)."""
    return {"axolotl_config_path": "sft.yml", "plugins": [PLUGIN], "trainer_cls": "transformers.Trainer", **keys}


def _dotted(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def test_a_bad_value_is_refused_naming_the_key_and_the_file() -> None:
    plugin = ElixirAxolotlPlugin()
    with pytest.raises(ElixirSpecError, match=r"unknown sft.yml's elixir key 'ofload' \(did you mean 'offload'\?\)"):
        plugin.register(_cfg(elixir={"ofload": 0.5}))
    with pytest.raises(ElixirSpecError, match=r"sft.yml's elixir 'yes please' is not understood"):
        plugin.register(_cfg(elixir="yes please"))
    with pytest.raises(ValidationError, match="the Axolotl config's elixir: ElixirConfig.offload must be"):
        _dotted(plugin.get_input_args())(elixir={"offload": 2})  # Axolotl's own validation, where register was skipped


@pytest.mark.parametrize("key", CONFLICTS)
def test_what_elixir_cannot_run_beside_is_refused_by_its_key(key: str) -> None:
    plugin = ElixirAxolotlPlugin()
    with pytest.raises(ElixirSpecError, match=rf"sft.yml: {key} is not supported with elixir"):
        plugin.register(_cfg(**{key: "dpo"}))
    plugin.register(_cfg(elixir=False, **{key: "dpo"}))  # elixir: off leaves Axolotl as it is


def test_an_optimizer_outside_the_engine_is_refused() -> None:
    plugin = ElixirAxolotlPlugin()
    with pytest.raises(ElixirSpecError, match="sft.yml: optimizer adamw_bnb_8bit is not supported with elixir"):
        plugin.register(_cfg(optimizer="adamw_bnb_8bit"))
    plugin.register(_cfg(optimizer="adamw_torch_fused"))


@pytest.mark.parametrize(
    ("value", "spec", "on"),
    [(None, "auto", True), (True, "auto", True), (False, "off", False), ({"offload": 0.5}, '{"offload": 0.5}', True)],
)
def test_the_key_reaches_the_training_arguments(value: object, spec: str, on: bool) -> None:
    plugin = ElixirAxolotlPlugin()
    cfg = _cfg() if value is None else _cfg(elixir=value)  # no key: listing the plugin asks for Elixir
    assert _dotted(plugin.get_input_args())(**({} if value is None else {"elixir": value})).elixir == value
    assert plugin.get_training_args(cfg) == {"elixir": spec}
    assert (plugin.get_trainer_cls(cfg) is not None) is on


def test_the_trainer_axolotl_builds_trains_on_the_engine(tmp_path) -> None:
    """As Axolotl's ``HFCausalTrainerBuilder.build``: its arguments class with the plugin's mixin, the
    plugin's training args among the keyword arguments, the plugin's Trainer class (here over the config's
    ``trainer_cls``, as Axolotl's own ``AxolotlTrainer`` needs Axolotl)."""
    plugin = ElixirAxolotlPlugin()
    cfg = _cfg(elixir=OFFLOAD_PLAN)
    plugin.register(cfg)

    @dataclass
    class AxolotlTrainingArguments(_dotted(plugin.get_training_args_mixin()), TrainingArguments):  # type: ignore[misc]
        pass

    base = training_args(str(tmp_path), max_steps=4, eval_strategy="no", gradient_accumulation_steps=1)
    kwargs = {f: getattr(base, f) for f in ("output_dir", "max_steps", "per_device_train_batch_size", "learning_rate",
                                            "logging_steps", "save_strategy", "report_to", "use_cpu", "seed")}  # fmt: skip
    args = AxolotlTrainingArguments(**kwargs, **plugin.get_training_args(cfg))
    trainer_cls = plugin.get_trainer_cls(cfg)
    assert issubclass(trainer_cls, ElixirTrainer) and issubclass(trainer_cls, Trainer)
    from hf_cases import VOCAB, TokenDataset

    trainer = trainer_cls(
        model=MODEL_BUILDERS["gpt2"](seed=0, vocab=VOCAB),
        args=args,
        train_dataset=TokenDataset(16),
        data_collator=default_data_collator,
    )
    assert trainer.elixir_plugin is not None and trainer.elixir_plugin.config.offload == 0.5
    assert isinstance(trainer.args, AxolotlTrainingArguments)  # Axolotl's fields kept under the Elixir ones
    trainer.train()
    assert len(history(trainer, "elixir/step_s")) == 4  # the engine stepped


def test_axolotls_own_plugin_manager_loads_it() -> None:
    base = pytest.importorskip(
        "axolotl.integrations.base", reason="Axolotl cannot be installed beside this transformers (docs/hf.md)"
    )
    from axolotl.integrations.config import merge_input_args, merge_training_args

    manager = base.PluginManager.get_instance()
    manager.register(PLUGIN)
    try:
        plugin = manager.plugins[PLUGIN]
        assert isinstance(plugin, base.BasePlugin)
        cfg = _cfg(elixir={"offload": 0.5})
        plugin.register(cfg)
        _, config_cls = merge_input_args()
        assert "elixir" in config_cls.model_fields
        mixins = merge_training_args()  # as axolotl.core.training_args makes its arguments classes

        @dataclass
        class AxolotlTrainingArguments(mixins, TrainingArguments):  # type: ignore[misc,valid-type]
            pass

        assert "elixir" in {f.name for f in fields(AxolotlTrainingArguments)}
        assert manager.get_training_args(cfg) == {"elixir": '{"offload": 0.5}'}
        assert issubclass(manager.get_trainer_cls(cfg), ElixirTrainer)
    finally:
        manager.plugins.pop(PLUGIN)
