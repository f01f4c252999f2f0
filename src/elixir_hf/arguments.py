"""``ElixirTrainingArguments``: ``TrainingArguments`` plus ``--elixir``.

Everything that can be wrong with the combination is rejected here, at argument parsing, before
a model is loaded. When Elixir is on, the engine owns the compute dtype: ``--bf16/--fp16`` (or
accelerate's ``mixed_precision``) become ``elixir_plugin.config.dtype`` and the Accelerator is given
``mixed_precision="no"``, so no autocast or GradScaler runs on top of the engine. The Trainer
must not move the model to the GPU (the engine places each chunk) nor wrap it in DataParallel.

A ``TrainingArguments`` subclass (TRL's ``SFTConfig``) gets ``--elixir`` through
``elixir_args(SFTConfig)``: the subclass first in the MRO, so its defaults are kept (``mixin.py``).

No half-migration passes silently: Elixir arguments under a Trainer that is not an
``ElixirTrainer`` (which would drop ``--bf16`` and train without the engine) fail when that Trainer
is built, and a launch the engine cannot run (N processes that see no GPU and were not told to use
the CPU, a rank without a GPU, a world size the arguments do not see: ``launch.py``) fails here,
at parsing, with one message for the job.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from transformers import TrainingArguments

from elixir_runtime import check_compile_options

from . import patches
from .launch import check_devices, check_launch
from .mixin import mixed_class
from .plugin import ENV_VAR, ElixirPlugin, ElixirSpecError, check_exclusive

__all__ = ["ElixirTrainingArguments", "SUPPORTED_OPTIMS", "as_elixir_args", "elixir_args"]

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""``--optim`` values that create ``torch.optim.AdamW``, which the engine runs over its shards."""


@dataclass
class ElixirTrainingArguments(TrainingArguments):
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "elixir"]

    elixir: dict | str | None = field(  # type: ignore[type-arg]  # transformers: a dict argument is `dict | str | None`
        default=None,
        metadata={
            "help": "Train with the Elixir engine: 'auto', 'off', a JSON object of ElixirConfig fields (and "
            f"lean_loss), or a .json file (settings or a saved elixir_plan.json). Unset: the {ENV_VAR} environment "
            "variable, else off.",
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
            check_devices("Trainer", cpu=bool(self.use_cpu))  # before transformers and Accelerate pick devices
        ours = not (dist.is_available() and dist.is_initialized())  # the process group these arguments start
        super().__post_init__()  # type: ignore[no-untyped-call]  # transformers' own is unannotated
        self.elixir_plugin = plugin
        if plugin is not None:
            plugin.resolve_dtype(self.mixed_precision)
            plugin.check_world_size(self.world_size)
            check_launch(self.world_size, "Trainer")
            self.mixed_precision = "no"
            patches.one_device_per_process(self)
            if ours and dist.is_available() and dist.is_initialized():
                # transformers passes --ddp_timeout to the process group on GPUs only: with --use_cpu
                # (gloo) a collective waited torch's default 30 minutes
                dist.distributed_c10d._set_pg_timeout(self.ddp_timeout_delta)

    # not arguments: the ElixirPlugin (set by __post_init__; the class's None for arguments made without
    # it, e.g. unpickled stock ones; init=False keeps it out of the command line and of to_dict, which the
    # reporters write as JSON), and whether an ElixirTrainer took these arguments
    elixir_plugin: ElixirPlugin | None = field(default=None, init=False, repr=False, compare=False)
    _elixir_trainer = False

    @property
    def place_model_on_device(self) -> bool | None:
        """Read once, by ``Trainer.__init__``: where a Trainer that is not an ``ElixirTrainer`` is
        caught before it moves the model or builds its Accelerator."""
        if self.elixir_plugin is None:
            return super().place_model_on_device
        if not self._elixir_trainer:
            raise ElixirSpecError(
                "Elixir is on (--elixir or ELIXIR_CONFIG) but these arguments were given to a Trainer that is not an "
                "ElixirTrainer: it would drop --bf16/--fp16 and train without the engine. Use elixir_hf.ElixirTrainer, "
                "elixir_hf.elixir_trainer(YourTrainer) for a Trainer subclass such as TRL's SFTTrainer, or launch the "
                "unmodified script with elixir-run; or pass --elixir off"
            )
        return False

    def _reject_incompatible(self) -> None:
        check_exclusive({"DeepSpeed": bool(self.deepspeed), "FSDP": bool(self.fsdp)})
        optim = getattr(self.optim, "value", self.optim)
        if optim not in SUPPORTED_OPTIMS:
            raise ElixirSpecError(
                f"--optim {optim} is not supported with Elixir, which runs AdamW over its chunk shards: use "
                f"--optim {' or --optim '.join(SUPPORTED_OPTIMS)} (the default), or turn Elixir off with --elixir off"
            )
        if self.torch_compile or self.torch_compile_mode or self.torch_compile_backend:  # either implies it
            try:
                check_compile_options(self.torch_compile_backend or "inductor", self.torch_compile_mode)
            except ValueError as exc:
                raise ElixirSpecError(f"--torch_compile_mode/--torch_compile_backend: {exc}") from None
        if getattr(self, "sync_ref_model", False):  # TRL's DPOConfig and kin
            raise ElixirSpecError(
                "--sync_ref_model true is not supported with Elixir: TRL's SyncRefModelCallback mixes the trained "
                "weights into the reference's through .data, which the engine keeps in chunks; drop --sync_ref_model "
                "(the reference stays the starting model), or turn Elixir off with --elixir off"
            )
        if self.fp16_full_eval or self.bf16_full_eval:
            raise ElixirSpecError(
                "--fp16_full_eval/--bf16_full_eval cast the whole model, which Elixir shards: drop the flag; "
                "evaluation already runs in the engine's dtype (--fp16/--bf16)"
            )


@functools.cache
def elixir_args(cls: type[TrainingArguments]) -> type[ElixirTrainingArguments]:
    """``cls`` (a ``TrainingArguments`` subclass, e.g. TRL's ``SFTConfig``) with the ``elixir`` field:
    ``cls`` first in the MRO, so its defaults and ``__post_init__`` come first, then Elixir's.

        args = elixir_hf.elixir_args(SFTConfig)(output_dir="out", elixir="auto", bf16=True)
    """
    made = mixed_class(
        cls,
        ElixirTrainingArguments,
        {
            "_VALID_DICT_FIELDS": [*dict.fromkeys([*cls._VALID_DICT_FIELDS, "elixir"])],
            # rebuilt from its base class: pickle could not find a class made at run time by name, and
            # the Trainer saves its arguments with torch.save into every checkpoint
            "__reduce__": lambda self: (_restore, (cls, self.__dict__)),
        },
    )
    return made if made in (cls, ElixirTrainingArguments) else dataclass(made)


def _restore(cls: type[TrainingArguments], state: dict[str, Any]) -> ElixirTrainingArguments:
    args = object.__new__(elixir_args(cls))  # type: ignore[arg-type]  # a class is hashable (mypy reads its instances')
    args.__dict__.update(state)
    return args


def as_elixir_args(args: TrainingArguments | None) -> ElixirTrainingArguments:
    """Arguments an ``ElixirTrainer`` can run: Elixir ones as they are; plain ones (or ``None``, the
    Trainer's default ``output_dir="tmp_trainer"``) rebuilt with ``elixir`` from ``ELIXIR_CONFIG``."""
    if isinstance(args, ElixirTrainingArguments):
        return args
    if args is None:
        return ElixirTrainingArguments(output_dir="tmp_trainer")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return elixir_args(type(args))(**values)  # type: ignore[arg-type]  # as in _restore
