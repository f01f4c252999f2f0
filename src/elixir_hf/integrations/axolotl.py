"""An Axolotl plugin: ``elixir:`` in an Axolotl YAML config trains with the Elixir engine.

    plugins:
      - elixir_hf.integrations.axolotl.ElixirAxolotlPlugin
    elixir: auto            # the default; or off, or a mapping of --elixir's keys: elixir: {offload: 0.5}

Axolotl's ``BasePlugin`` hooks it implements:

* ``register``: the key checked before Axolotl validates the config, a bad value (and what Elixir
  cannot run: ``CONFLICTS``) refused naming the key and the file;
* ``get_input_args``: ``ElixirArgs``, which declares ``elixir`` in Axolotl's config schema;
* ``get_training_args_mixin`` / ``get_training_args``: the ``elixir`` field on Axolotl's training
  arguments, and its value;
* ``get_trainer_cls``: with Elixir on, ``elixir_trainer`` of the Trainer Axolotl would build
  (``AxolotlTrainer``, or the config's ``trainer_cls``). An ``ElixirTrainer`` rebuilds the arguments it
  is given as Elixir ones (``as_elixir_args``), their ``elixir`` field included: the engine, its
  checks and its checkpoints are the Trainer's (docs/hf.md).

[Note: Axolotl not installed]
Axolotl 0.19 pins transformers 5.16.1 and accelerate 1.13, below what elixir-hf supports (docs/hf.md,
"Axolotl"): it cannot be installed beside it, and this module must import without it for its hooks to
be tested. The class extends Axolotl's ``BasePlugin`` where Axolotl is installed (where only it loads
the plugin) and ``object`` elsewhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, field_validator

from ..arguments import SUPPORTED_OPTIMS
from ..config_file import spec_of
from ..plugin import ElixirPlugin, ElixirSpecError
from ..trainer import ElixirTrainer, elixir_trainer

__all__ = ["CONFLICTS", "ElixirAxolotlPlugin", "ElixirArgs", "ElixirTrainingMixin"]

CONFLICTS = {
    "rl": "Axolotl's RL trainers (DPO, KTO, ORPO, GRPO) get no trainer class from a plugin with their arguments: "
    "run TRL's DPOTrainer through elixir-run (docs/hf.md)",
    "reward_model": "a reward model's trainer is Axolotl's own choice: train it with TRL's RewardTrainer under elixir-run",
    "process_reward_model": "a process reward model's trainer is Axolotl's own choice",
    "deepspeed": "DeepSpeed shards the model as Elixir does: use one of them",
    "fsdp": "FSDP shards the model as Elixir does: use one of them",
    "fsdp_config": "FSDP shards the model as Elixir does: use one of them",
    "loraplus_lr_ratio": "Axolotl builds this optimizer itself, outside the engine",
    "embedding_lr": "Axolotl builds this optimizer itself, outside the engine",
    "embedding_lr_scale": "Axolotl builds this optimizer itself, outside the engine",
    "lr_groups": "Axolotl builds this optimizer itself, outside the engine",
}
"""Axolotl config keys that Elixir cannot run beside, and why; refused while Elixir is on."""


class ElixirArgs(BaseModel):
    """The key this plugin adds to Axolotl's config (merged into ``AxolotlInputConfig``)."""

    elixir: str | bool | dict[str, object] | None = None

    @field_validator("elixir")
    @classmethod
    def _parses(cls, value: str | bool | dict[str, object] | None) -> str | bool | dict[str, object] | None:
        ElixirPlugin.from_spec(value, "the Axolotl config's elixir")  # register has named the file already
        return value


@dataclass
class ElixirTrainingMixin:
    """The ``elixir`` field on Axolotl's training arguments (``AxolotlTrainingMixins``)."""

    elixir: str | None = field(default=None, metadata={"help": "--elixir's value (the Axolotl config's elixir key)"})


def _spec(cfg: Mapping[str, object]) -> str:
    """The config's ``elixir`` key as a spec; ``auto`` without it (listing the plugin asks for Elixir)."""
    value = cfg.get("elixir")
    return "auto" if value is None else spec_of(value)


def _source(cfg: Mapping[str, object]) -> str:
    path = cfg.get("axolotl_config_path")
    return f"{path}'s elixir" if path else "the Axolotl config's elixir"


def _on(cfg: Mapping[str, object]) -> bool:
    return ElixirPlugin.from_spec(_spec(cfg), _source(cfg)) is not None


def _axolotl_base() -> type:
    try:
        from axolotl.integrations.base import BasePlugin  # type: ignore[import-not-found]
    except ImportError:  # [Note: Axolotl not installed]
        return object
    return BasePlugin  # type: ignore[no-any-return]


if TYPE_CHECKING:
    _Base = object
else:
    _Base = _axolotl_base()


class ElixirAxolotlPlugin(_Base):
    """``plugins: [elixir_hf.integrations.axolotl.ElixirAxolotlPlugin]``: the Axolotl config's ``elixir`` key."""

    def register(self, cfg: Mapping[str, object]) -> None:
        """The config as read from its file (``cfg.axolotl_config_path``), before Axolotl validates it."""
        if not _on(cfg):
            return
        where = cfg.get("axolotl_config_path") or "the Axolotl config"
        for key, why in CONFLICTS.items():
            if cfg.get(key):
                raise ElixirSpecError(f"{where}: {key} is not supported with elixir ({why}); or set elixir: off")
        optim = cfg.get("optimizer")
        if optim is not None and optim not in SUPPORTED_OPTIMS:
            raise ElixirSpecError(
                f"{where}: optimizer {optim} is not supported with elixir, which runs AdamW over its chunk shards: use "
                f"optimizer: {' or '.join(SUPPORTED_OPTIMS)} (Axolotl's default), or set elixir: off"
            )

    def get_input_args(self) -> str:
        return f"{__name__}.ElixirArgs"

    def get_training_args_mixin(self) -> str:
        return f"{__name__}.ElixirTrainingMixin"

    def get_training_args(self, cfg: Mapping[str, object]) -> dict[str, str]:
        return {"elixir": _spec(cfg)}

    def get_trainer_cls(self, cfg: Mapping[str, object]) -> type[ElixirTrainer] | None:
        if not _on(cfg):
            return None
        name = cfg.get("trainer_cls")
        if name:
            module, _, attr = str(name).rpartition(".")  # a dotted name (Axolotl's schema)
            base = getattr(importlib.import_module(module), attr)
        else:
            from axolotl.core.trainers.base import AxolotlTrainer  # type: ignore[import-not-found]

            base = AxolotlTrainer
        return elixir_trainer(base)
