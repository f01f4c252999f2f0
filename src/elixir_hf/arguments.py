"""``ElixirTrainingArguments``: ``TrainingArguments`` plus ``--elixir``.

Everything that can be wrong with the combination is rejected here, at argument parsing, before
a model is loaded. When Elixir is on, the engine owns the compute dtype: ``--bf16/--fp16`` (or
accelerate's ``mixed_precision``) become ``elixir_plugin.dtype`` and the Accelerator is given
``mixed_precision="no"``, so no autocast or GradScaler runs on top of the engine. The Trainer
must not move the model to the GPU (the engine places each chunk) nor wrap it in DataParallel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .plugin import ENV_VAR, ElixirPlugin, ElixirSpecError, check_exclusive

__all__ = ["ElixirTrainingArguments", "SUPPORTED_OPTIMS"]

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""``--optim`` values that create ``torch.optim.AdamW``, which the engine runs over its shards."""


@dataclass
class ElixirTrainingArguments(TrainingArguments):
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "elixir"]

    elixir: dict | str | None = field(
        default=None,
        metadata={
            "help": "Train with the Elixir engine: 'auto', 'off', a JSON object of ElixirPlugin fields, or a .json "
            f"file (settings or a saved elixir_plan.json). Unset: the {ENV_VAR} environment variable, else off.",
            "nargs": "?",
            "const": "auto",
        },
    )

    def __post_init__(self) -> None:
        source = "--elixir"
        if self.elixir is None:
            self.elixir, source = os.environ.get(ENV_VAR), ENV_VAR
        plugin = ElixirPlugin.from_spec(self.elixir, source)
        if plugin is not None:
            self._reject_incompatible()
        super().__post_init__()
        self.elixir_plugin = plugin
        if plugin is not None:
            plugin.resolve_dtype(self.mixed_precision)
            plugin.check_world_size(self.world_size)
            self.mixed_precision = "no"
            self._n_gpu = min(self._n_gpu, 1)

    @property
    def place_model_on_device(self) -> bool | None:
        return False if self.elixir_plugin is not None else super().place_model_on_device

    def _reject_incompatible(self) -> None:
        check_exclusive({"DeepSpeed": bool(self.deepspeed), "FSDP": bool(self.fsdp)})
        optim = getattr(self.optim, "value", self.optim)
        if optim not in SUPPORTED_OPTIMS:
            raise ElixirSpecError(
                f"--optim {optim} is not supported with Elixir, which runs AdamW over its chunk shards: use "
                f"--optim {' or --optim '.join(SUPPORTED_OPTIMS)} (the default), or turn Elixir off with --elixir off"
            )
        if self.torch_compile:
            raise ElixirSpecError("--torch_compile is not supported with Elixir yet: drop it, or pass --elixir off")
        if self.fp16_full_eval or self.bf16_full_eval:
            raise ElixirSpecError(
                "--fp16_full_eval/--bf16_full_eval cast the whole model, which Elixir shards: drop the flag; "
                "evaluation already runs in the engine's dtype (--fp16/--bf16)"
            )
