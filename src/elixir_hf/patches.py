"""Every place elixir_hf relies on a private surface of another library, and what each reliance assumes.

Three kinds, a row of ``PATCHES`` each:

* a **patch** (``kind="patch"``): an object of transformers, accelerate, PEFT, TRL or torch that
  elixir_hf replaces, swaps for the length of a call, or marks so that the library reads it
  differently: a module global, a class's method or constructor, a method on one instance, a
  private attribute or registry the library reads. Each is made by one function below, and nowhere
  else: no other module of elixir_hf writes a library's private attribute;
* an **override** (``kind="override"``): a method or class attribute of an elixir_hf subclass
  (``ElixirTrainer``, ``ElixirTrainingArguments``) that replaces a private one of its library base,
  which the library calls by that name;
* a **read** (``kind="read"``): a private attribute or function of a library that elixir_hf reads
  or calls where it is (``by`` names each place).

The rest of elixir_hf subclasses (``Trainer``, ``TrainingArguments``, ``Accelerator``,
``AcceleratedOptimizer``) and calls public API. The callers keep what is theirs (what to load, when
to rotate); the patch functions only reach in.

A row names the object, the upstream code that reads it (calls it, or sets it), where elixir_hf does
it, the versions it was verified against, and what goes wrong, silently, if upstream moves it.
``tests/elixir_hf/test_patches.py`` holds one contract test per row (the object still exists with
the signature elixir_hf assumes, and its reader still looks it up there), failing by the row's
name; a patch function without a row, a row without a contract, a private override or read not in
a row, a write into a library's private attribute outside this module, or an installed
transformers, accelerate, PEFT, TRL, torch or datasets outside a row's ``verified`` fails there too.
On a new version: run that file (under each supported transformers: ``make test`` does), then add
the version to the constants below.

The libraries are imported inside the functions, each when its patch is made: importing this module
loads none of them (``loading/`` imports it, and must not pull in the Trainer stack or PEFT).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from unittest import mock

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "PATCHES",
    "Patch",
    "before_inject_adapter",
    "config_key_taken",
    "construct_elixir",
    "deferred_rotation",
    "from_pretrained_through",
    "hidden_from_accelerate",
    "mask_decisions_of",
    "mark_accelerate_prepared",
    "mark_initialized",
    "mark_optimizer_stepped",
    "one_device_per_process",
    "register_optimizer",
    "keep_weight_conversions",
    "replace_get_last_checkpoint",
    "save_messages_name",
    "save_pretrained_where_told",
    "trainer_accelerator",
    "weights_recorded_not_read",
]

# The private attributes this module writes on library objects, each named by the Protocol of the objects that carry it.


class _GpuCount(Protocol):
    _n_gpu: int  # transformers' TrainingArguments


class _HfInitialized(Protocol):
    _is_hf_initialized: bool  # a tensor transformers' from_pretrained loaded


class _WeightConversions(Protocol):
    _weight_conversions: list[object]  # a PreTrainedModel


class _Registries(Protocol):
    _optimizers: list[object]  # an accelerate Accelerator's
    _models: list[object]


class _OptCalled(Protocol):
    _opt_called: bool  # a torch optimizer a scheduler is built on


_FromPretrained = Callable[..., "PreTrainedModel"]
"""transformers' own ``from_pretrained`` of a model class or an Auto class."""


@dataclass(frozen=True)
class Patch:
    target: str
    """The object patched, overridden or read (a dotted name; ``model.`` / ``optimizer.`` / ``tensor.``: an
    attribute of that instance)."""
    read_by: str
    """The upstream code the reliance is on: where ``target`` is looked up (a patch, an override), or set (a read)."""
    by: str
    """Where elixir_hf does it: a patch, the function of this module that makes it; an override or a read, each
    place as ``module.qualified_name`` inside ``elixir_hf`` (comma-separated)."""
    breaks: str
    """What goes wrong, without an error, if upstream moves or renames it."""
    verified: tuple[str, ...]
    """``"package version"``: the versions the row's contract passed on (each supported one must be here)."""
    kind: str = "patch"
    """``patch``, ``override`` or ``read``."""


_TRANSFORMERS = ("transformers 5.17.0", "transformers 5.25.0")  # the GPU image's; the newest (make test's two passes)
_ACCELERATE = ("accelerate 1.15.0", "accelerate 1.16.0")  # the GPU image's; the venv's
_TORCH = ("torch 2.11.0", "torch 2.13.0")  # the GPU image's; the venv's (CPU)
_PEFT = ("peft 0.21.0", "peft 0.21.2")  # the GPU image's; the venv's
_TRL = ("trl 1.16.0",)
_DATASETS = ("datasets 5.2.0",)

PATCHES: tuple[Patch, ...] = (
    Patch(
        "transformers.trainer.Accelerator",
        "transformers.Trainer.create_accelerator_and_postprocess",
        "trainer_accelerator",
        "an ElixirTrainer gets a stock Accelerator: it places and wraps the model the engine runs (.to(), DDP, "
        "autocast), backward skips the engine's loss scaling, clipping and reduction, no elixir/* metrics",
        _TRANSFORMERS + _ACCELERATE,
    ),
    Patch(
        "transformers.trainer.rotate_checkpoints",
        "transformers.Trainer._save_checkpoint",
        "deferred_rotation",
        "older checkpoints are deleted before the new one is sealed: a crash during the save can leave no "
        "complete checkpoint to resume from",
        _TRANSFORMERS,
    ),
    Patch(
        "model.should_save_on_this_rank",
        "transformers.PreTrainedModel.save_pretrained",
        "save_pretrained_where_told",
        "with save_on_each_node, the checkpoints on every node but rank 0's hold no weights",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.modeling_utils.convert_and_load_state_dict_in_model",
        "transformers.PreTrainedModel._load_pretrained_model",
        "weights_recorded_not_read",
        "from_pretrained reads every tensor on every rank (the host holds the model once per rank) and the "
        "streamed load then refuses the model",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.PreTrainedModel.from_pretrained",
        "every model class's from_pretrained (the Auto classes call it)",
        "from_pretrained_through",
        "under elixir-run, a script's from_pretrained loads the whole model on every rank: host memory per rank "
        "is the model's size again",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.models.auto.auto_factory._BaseAutoModelClass.from_pretrained",
        "AutoModelForCausalLM.from_pretrained and every Auto class's own copy of it (auto_class_update)",
        "from_pretrained_through",
        "under elixir-run, an Auto class reads a Hub id's config through transformers on every rank before the "
        "download once, and offline without the model cached stops with transformers' traceback instead of the "
        "command that downloads it",
        _TRANSFORMERS,
    ),
    Patch(
        "peft.tuners.tuners_utils.BaseTuner.inject_adapter",
        "peft.tuners.tuners_utils.BaseTuner.__init__ (get_peft_model, TRL's peft_config)",
        "before_inject_adapter",
        "a PEFT adapter added to a streamed model is made on its base layers' device, meta: its initial "
        "values are lost",
        _PEFT,
    ),
    Patch(
        "trl.TrlParser.set_defaults_with_config",
        "trl.TrlParser.parse_args_and_config (a --config YAML file's keys)",
        "config_key_taken",
        "under elixir-run, a YAML config's elixir key (read by elixir-run) fails a strict TrlParser as an unknown "
        "argument, or reaches arguments that know the field and beats the command line's --elixir",
        _TRL,
    ),
    Patch(
        "transformers.trainer_utils.get_last_checkpoint",
        "scripts' restart loops (run_clm's shape), and every module that imported it by name",
        "replace_get_last_checkpoint",
        "under elixir-run, a restart after a kill during a save resumes from the torn checkpoint and fails, at "
        "every restart",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.TrainingArguments.__new__",
        "TrainingArguments(...) and every subclass's construction (TRL's SFTConfig)",
        "construct_elixir",
        "under elixir-run, the script's arguments are stock ones: --elixir and ELIXIR_CONFIG are ignored; a "
        "__new__ of upstream's own would be replaced",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.Trainer.__new__",
        "Trainer(...) and every subclass's construction (TRL's SFTTrainer)",
        "construct_elixir",
        "under elixir-run, the script trains with the stock Trainer, without the engine; a __new__ of "
        "upstream's own would be replaced",
        _TRANSFORMERS,
    ),
    Patch(
        "accelerate.Accelerator.__new__",
        "Accelerator(...) and every subclass's construction",
        "construct_elixir",
        "under elixir-run, an Accelerate script trains with the stock Accelerator, without the engine; a "
        "__new__ of upstream's own would be replaced",
        _ACCELERATE,
    ),
    Patch(
        "accelerate.Accelerator._optimizers",
        "accelerate.Accelerator.save_state / load_state",
        "hidden_from_accelerate",
        "save_state also writes the main process's own optimizer shards as the optimizer state, and load_state "
        "loads them over the engine's",
        _ACCELERATE,
    ),
    Patch(
        "accelerate.Accelerator._models",
        "accelerate.Accelerator.load_state",
        "hidden_from_accelerate",
        "load_state also loads the weights into the model with a plain load_state_dict, a whole copy of the "
        "file per rank, over the engine's load",
        _ACCELERATE,
    ),
    Patch(
        "model._is_accelerate_prepared",
        "accelerate.Accelerator.prepare_model",
        "mark_accelerate_prepared",
        "prepare moves, wraps (DDP) and autocasts the model the engine places and reduces",
        _ACCELERATE,
    ),
    Patch(
        "optimizer._opt_called",
        "torch.optim.lr_scheduler.LRScheduler.step",
        "mark_optimizer_stepped",
        "torch warns that the scheduler steps before the optimizer, on every Accelerate run",
        _TORCH,
    ),
    Patch(
        "transformers.masking_utils._ignore_causal_mask_sdpa",
        "transformers.masking_utils.sdpa_mask (create_causal_mask and the other mask builders)",
        "mask_decisions_of",
        "the planner's profile, on fake tensors, prices a full attention mask and a kernel that computes both "
        "triangles where the run passes is_causal=True: attention's FLOPs twice the run's, and the mask's memory",
        _TRANSFORMERS,
    ),
    Patch(
        "transformers.masking_utils.find_packed_sequence_indices",
        "transformers.masking_utils._preprocess_mask_arguments (create_causal_mask and the other mask builders)",
        "mask_decisions_of",
        "the planner's profile, on fake tensors, takes every batch for packed sequences when the model makes its "
        "own position ids (use_cache=False, as under gradient checkpointing): a full mask and twice the attention",
        _TRANSFORMERS,
    ),
    Patch(
        "the handlers of the 'transformers' logger (and the root logger's)",
        "transformers.Trainer._save and PreTrainedModel.save_pretrained: 'Saving model checkpoint to ...', "
        "'Model weights saved in ...'",
        "save_messages_name",
        "the save messages name the temporary staging folder, not the one the files end up in",
        _TRANSFORMERS,
    ),
    Patch(
        "accelerate.Accelerator._optimizers",
        "accelerate.Accelerator.optimizer_step_was_skipped (the Trainer steps its scheduler by it), save_state, "
        "load_state, free_memory",
        "register_optimizer",
        "optimizer_step_was_skipped stays False: in fp16 a step the engine skips (inf/NaN gradients) still advances "
        "the learning-rate schedule",
        _ACCELERATE,
    ),
    Patch(
        "transformers.TrainingArguments._n_gpu",
        "transformers.TrainingArguments.n_gpu (above 1 the Trainer wraps the model in DataParallel and scales the "
        "batch by it)",
        "one_device_per_process",
        "on a multi-GPU host started without a launcher, the Trainer wraps the engine's model in DataParallel "
        "and scales the batch by the GPU count",
        _TRANSFORMERS,
    ),
    Patch(
        "tensor._is_hf_initialized",
        "transformers.initialization (the guarded init functions) and PreTrainedModel._initialize_weights",
        "mark_initialized",
        "transformers re-initialises the parameters and buffers the streamed load took from the checkpoint: the "
        "model trains from random weights",
        _TRANSFORMERS,
    ),
    Patch(
        "model._weight_conversions",
        "transformers.core_model_loading.revert_weight_conversion (save_pretrained)",
        "keep_weight_conversions",
        "save_pretrained of a streamed model stops reverting the checkpoint's key renames: the saved folder's keys "
        "differ from the ones it was loaded from",
        _TRANSFORMERS,
    ),
    # ------------------------------------------------------------------ overrides of private methods
    Patch(
        "transformers.Trainer._save_checkpoint",
        "transformers.Trainer._maybe_log_save_evaluate",
        "trainer.ElixirTrainer._save_checkpoint",
        "checkpoints get no marker and the older ones are rotated out before the new one is complete: a resume "
        "cannot verify one, and a kill during the save can leave none to resume from",
        _TRANSFORMERS,
        kind="override",
    ),
    Patch(
        "transformers.Trainer._save_optimizer_and_scheduler",
        "transformers.Trainer._save_checkpoint",
        "trainer.ElixirTrainer._save_optimizer_and_scheduler",
        "the checkpoint holds the stock optimizer.pt of rank 0's shards only (no state by parameter name, nothing "
        "of the other ranks): a resume restarts the other ranks' Adam state",
        _TRANSFORMERS,
        kind="override",
    ),
    Patch(
        "transformers.Trainer._load_from_checkpoint",
        "transformers.Trainer.train / _prepare_for_training (a resume)",
        "trainer.ElixirTrainer._load_from_checkpoint",
        "a resume loads the checkpoint's weights unverified, with a whole copy of the file per rank, into a model "
        "streamed or built on meta",
        _TRANSFORMERS,
        kind="override",
    ),
    Patch(
        "transformers.Trainer._load_optimizer_and_scheduler",
        "transformers.Trainer._prepare_for_training (a resume)",
        "trainer.ElixirTrainer._load_optimizer_and_scheduler",
        "a resume finds no optimizer.pt and restarts AdamW and the learning-rate schedule from zero",
        _TRANSFORMERS,
        kind="override",
    ),
    Patch(
        "transformers.TrainingArguments._VALID_DICT_FIELDS",
        "transformers.TrainingArguments.__post_init__ (a JSON string of a dict field becomes the dict)",
        "arguments.ElixirTrainingArguments, arguments.elixir_args",
        "--elixir '{...}' stays a string in the arguments (to_dict and the reporters' copy of them); the plugin "
        "still parses it",
        _TRANSFORMERS,
        kind="override",
    ),
    Patch(
        "trl.DPOTrainer._precompute_ref_logps",
        "trl.DPOTrainer.__init__ and evaluate (precompute_ref_log_probs)",
        "trainer.elixir_trainer",
        "the reference log-probabilities are computed before the engine is built: the model's forward runs "
        "outside the engine, on the host or the whole model on one GPU",
        _TRL,
        kind="override",
    ),
    # ------------------------------------------------------------------ private names read
    Patch(
        "transformers.Trainer._get_output_dir",
        "transformers.Trainer._save_checkpoint (the folder of checkpoint-N)",
        "trainer.ElixirTrainer._save_checkpoint, preemption.Preemption.on_step_end, preemption.Preemption.on_save",
        "the marker is sealed, and the preemption save looked for, in another folder than the Trainer's "
        "checkpoint: a resume finds the checkpoint unmarked (torn)",
        _TRANSFORMERS,
        kind="read",
    ),
    Patch(
        "transformers.Trainer._save",
        "transformers.Trainer.save_model (the weights, the config, the tokenizer, training_args.bin)",
        "trainer.ElixirTrainer._save_model",
        "an Elixir save writes the stock files no longer (or another set): the output folder differs from the "
        "stock Trainer's",
        _TRANSFORMERS,
        kind="read",
    ),
    Patch(
        "transformers.Trainer._train_batch_size",
        "transformers.Trainer.__init__ / get_train_dataloader (the per-device batch, auto_find_batch_size's)",
        "trainer.ElixirTrainer.create_optimizer",
        "the engine is planned for another batch size than the dataloader's: a plan that does not fit, or one "
        "that leaves memory unused",
        _TRANSFORMERS,
        kind="read",
    ),
    Patch(
        "transformers.trainer_jit_checkpoint.CheckpointManager._original_sigterm_handler",
        "transformers.trainer_jit_checkpoint (the SIGTERM handler --enable_jit_checkpoint installs)",
        "trainer._drop_jit_checkpoint",
        "with --enable_jit_checkpoint, transformers' SIGTERM handler stays: a SIGTERM saves on the rank it "
        "reaches, alone, and an Elixir save is a collective of every rank (a hang)",
        _TRANSFORMERS,
        kind="read",
    ),
    Patch(
        "transformers.PreTrainedModel._from_config",
        "the model classes' construction from a config (AutoModel*.from_config calls it)",
        "loading.model.from_config",
        "elixir_hf.from_config(ModelClass, config) fails with an AttributeError (only the Auto classes have "
        "from_config)",
        _TRANSFORMERS,
        kind="read",
    ),
    Patch(
        "accelerate.Accelerator._optimizers",
        "accelerate.Accelerator.prepare_optimizer (the optimizers it wraps, in order)",
        "accelerator.ElixirAccelerator.elixir_optimizer",
        "the Accelerator no longer finds the engine's optimizer: backward, clipping and no_sync fall back to "
        "Accelerate's own on the engine's model",
        _ACCELERATE,
        kind="read",
    ),
    Patch(
        "accelerate.Accelerator._models",
        "accelerate.Accelerator.prepare_model (the models it prepared)",
        "accelerator.ElixirAccelerator._collective, accelerator.ElixirAccelerator.load_state",
        "a collective between the steps that fails because another rank gave up raises gloo's error, not that "
        "rank's; load_state finds no model the engine runs",
        _ACCELERATE,
        kind="read",
    ),
    Patch(
        "accelerate.PartialState._shared_state",
        "accelerate.PartialState.__init__ (the devices and process group, picked once per process)",
        "accelerator.ElixirAccelerator.__init__",
        "the device check runs again after the Trainer's arguments picked the devices, or never before "
        "Accelerate picks them (a job with more ranks than GPUs reaches CUDA's error instead of the check's)",
        _ACCELERATE,
        kind="read",
    ),
    Patch(
        "torch.distributed.distributed_c10d._set_pg_timeout",
        "torch.distributed's default process group (the timeout of its collectives)",
        "arguments.ElixirTrainingArguments.__post_init__",
        "with --use_cpu (gloo) a collective waits torch's default 30 minutes instead of --ddp_timeout",
        _TORCH,
        kind="read",
    ),
    Patch(
        "torch._log_softmax_backward_data",
        "torch's log_softmax backward (grad_output, output, dim, input_dtype)",
        "loss._CrossEntropySum.backward",
        "if its arguments change order or meaning, the lean loss's gradient is wrong: the run trains on a wrong "
        "gradient without an error",
        _TORCH,
        kind="read",
    ),
    Patch(
        "datasets.Dataset._indices",
        "datasets.Dataset.select / shuffle / train_test_split (the rows a selected dataset holds)",
        "batch_plan._arrow_lengths",
        "the planner reads the lengths of the unselected rows: it plans for a longest batch the run never sees",
        _DATASETS,
        kind="read",
    ),
)


# ---------------------------------------------------------------------------------- the Trainer
@contextlib.contextmanager
def trainer_accelerator(factory: Callable[..., object]) -> Iterator[None]:
    """Inside, the Trainer's ``Accelerator(**args)`` (a global of ``transformers.trainer``, hard-coded in
    ``create_accelerator_and_postprocess``) is ``factory(**args)``."""
    import transformers.trainer

    with mock.patch.object(transformers.trainer, "Accelerator", factory):
        yield


@contextlib.contextmanager
def deferred_rotation() -> Iterator[Callable[[], None]]:
    """Inside, the Trainer's rotation of older checkpoints (``rotate_checkpoints(**kwargs)`` at the end of
    ``_save_checkpoint``) is recorded, not run; the callable yielded runs it, once the new checkpoint is
    complete (until then the older ones are what a resume falls back to)."""
    import transformers.trainer

    stock = transformers.trainer.rotate_checkpoints
    rotations: list[Callable[[], None]] = []

    def rotate() -> None:
        for rotation in rotations:
            rotation()

    with mock.patch.object(
        transformers.trainer, "rotate_checkpoints", lambda **kw: rotations.append(functools.partial(stock, **kw))
    ):
        yield rotate


def save_pretrained_where_told(model: object) -> contextlib.AbstractContextManager[object]:
    """transformers' ``save_pretrained`` writes on global rank 0 only once torch.distributed is up
    (``should_save_on_this_rank``), whatever ``is_main_process`` says, which leaves the weights off
    every other node under ``save_on_each_node``. Inside, the caller (the Trainer's ``should_save``:
    rank 0, or each node's main process) decides."""
    if not hasattr(model, "should_save_on_this_rank"):
        return contextlib.nullcontext()
    return mock.patch.object(model, "should_save_on_this_rank", lambda is_main_process: is_main_process)


@contextlib.contextmanager
def save_messages_name(stage: str, final: str | os.PathLike[str]) -> Iterator[None]:
    """transformers' save messages ("Saving model checkpoint to ...", "Model weights saved in
    ...") name the folder the files end up in, ``final``, not the staging folder they are written to.

    A filter on the handlers of transformers' logger and of the root logger (where its records go
    when a script turns propagation on), for the duration of the save."""

    class Rename(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if stage in message:
                record.msg, record.args = message.replace(stage, str(final)), ()
            return True

    rename = Rename()
    handlers = {h for name in ("transformers", None) for h in logging.getLogger(name).handlers}
    for handler in handlers:
        handler.addFilter(rename)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(rename)


# ---------------------------------------------------------------------------------- the planner's profile
@contextlib.contextmanager
def mask_decisions_of(batch: object) -> Iterator[None]:
    """Inside, transformers' two mask decisions that read tensor values are answered from ``batch``
    (one real training batch) when asked of fake ones: the batch is unpadded (SDPA's ``is_causal``
    replaces the mask) and its sequences are not packed, as the run will answer them.

    [Note: the profile's masks] The planner traces a step on fake tensors, whose values cannot be
    read, so transformers takes the safe branch of each decision: it builds the full ``seq x seq``
    mask and SDPA computes both triangles of the scores. The run, on real tensors, passes
    ``is_causal=True``, no mask, and a kernel that skips the masked half. Without this the profile
    prices twice the run's attention FLOPs and a mask the run never allocates (``batch x seq^2``
    elements; docs/planning.md, "The masks the run uses"). A padded or packed batch keeps
    transformers' own answer, the mask, as the run does."""
    if not isinstance(batch, Mapping):
        yield
        return
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    values = [batch.get("attention_mask"), batch.get("position_ids")]
    if any(isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t)) for t in values):
        yield  # a batch without values decides nothing
        return
    mask, positions = values
    unpadded = not isinstance(mask, torch.Tensor) or bool(mask.all())
    packed = isinstance(positions, torch.Tensor) and masking_utils.find_packed_sequence_indices(positions) is not None
    ignore_mask: Callable[..., bool] = masking_utils._ignore_causal_mask_sdpa  # its arguments differ by version
    packed_indices = masking_utils.find_packed_sequence_indices

    def ignore_causal_mask(padding_mask: torch.Tensor | None, *args: object, **kwargs: object) -> bool:
        if unpadded and padding_mask is not None and is_fake(padding_mask):
            padding_mask = None  # all ones: transformers answers as for no mask
        return ignore_mask(padding_mask, *args, **kwargs)

    def packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if not packed and is_fake(position_ids) else packed_indices(position_ids)

    with (
        mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa", ignore_causal_mask),
        mock.patch.object(masking_utils, "find_packed_sequence_indices", packed_sequence_indices),
    ):
        yield


# ---------------------------------------------------------------------------------- loading
def weights_recorded_not_read(record: Callable[..., object]) -> contextlib.AbstractContextManager[object]:
    """Inside, ``from_pretrained`` hands each checkpoint's tensors to ``record`` (same arguments and
    result as transformers' ``convert_and_load_state_dict_in_model``) instead of reading them into the
    parameters."""
    import transformers.modeling_utils

    return mock.patch.object(transformers.modeling_utils, "convert_and_load_state_dict_in_model", record)


def from_pretrained_through(
    load: Callable[[_FromPretrained, type, str | os.PathLike[str], dict[str, object]], PreTrainedModel],
) -> None:
    """From now on, ``SomeModel.from_pretrained(name_or_path, **kwargs)`` of every model class and of
    every Auto class is ``load(stock, SomeModel, name_or_path, kwargs)``, where ``stock(name_or_path,
    **kwargs)`` is transformers' own; calls with extra positional arguments or no name go to
    transformers as they are. Once per process.

    transformers gives each Auto class its own copy of ``_BaseAutoModelClass.from_pretrained``
    (``auto_class_update``): each copy is patched."""
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto  # noqa: F401 - defines the Auto classes
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    for owner in (PreTrainedModel, *_copies_of(_BaseAutoModelClass, "from_pretrained")):
        stock = owner.__dict__["from_pretrained"].__func__
        if not getattr(stock, "_elixir", False):
            owner.from_pretrained = classmethod(_through(stock, load))  # type: ignore[attr-defined]


def _copies_of(base: type, name: str) -> list[type]:
    """The subclasses of ``base``, at any depth, whose own classmethod ``name`` is a copy of ``base``'s."""
    code = vars(base)[name].__func__.__code__
    found: list[type] = []
    todo: list[type] = [base]
    while todo:
        subclasses: list[type] = todo.pop().__subclasses__()
        for cls in subclasses:
            todo.append(cls)
            own = vars(cls).get(name)
            if isinstance(own, classmethod) and inspect.unwrap(own.__func__).__code__ is code:
                found.append(cls)
    return found


def _through(
    stock: _FromPretrained,
    load: Callable[[_FromPretrained, type, str | os.PathLike[str], dict[str, object]], PreTrainedModel],
) -> _FromPretrained:
    @functools.wraps(stock)
    def from_pretrained(
        cls: type, name_or_path: str | os.PathLike[str] | None, *args: object, **kwargs: object
    ) -> PreTrainedModel:
        if args or name_or_path is None:
            return stock(cls, name_or_path, *args, **kwargs)
        return load(functools.partial(stock, cls), cls, name_or_path, kwargs)

    from_pretrained._elixir = True  # type: ignore[attr-defined]
    return from_pretrained


def before_inject_adapter(hook: Callable[[torch.nn.Module], None]) -> None:
    """From now on, PEFT's ``BaseTuner.inject_adapter(model, ...)`` (which ``get_peft_model`` and TRL's
    ``peft_config`` reach) runs ``hook(model)`` first. Nothing without PEFT; once per process."""
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return
    stock: Callable[..., None] = BaseTuner.inject_adapter  # the caller's arguments, passed on as they are
    if getattr(stock, "_elixir", False):
        return

    @functools.wraps(stock)
    def inject_adapter(self: BaseTuner, model: torch.nn.Module, *args: object, **kwargs: object) -> None:
        hook(model)
        return stock(self, model, *args, **kwargs)

    inject_adapter._elixir = True  # type: ignore[attr-defined]
    BaseTuner.inject_adapter = inject_adapter  # type: ignore[method-assign]


def one_device_per_process(args: _GpuCount) -> None:
    """``args.n_gpu`` at most 1: the Trainer's ``DataParallel`` (and its batch times the GPUs) is for a
    process that drives every visible GPU; the engine's process drives one."""
    args._n_gpu = min(args._n_gpu, 1)


def mark_initialized(tensor: _HfInitialized) -> None:
    """transformers' mark for a tensor ``from_pretrained`` loaded: its initialisation skips it."""
    tensor._is_hf_initialized = True


def keep_weight_conversions(model: _WeightConversions, conversions: list[object]) -> None:
    """The key renames and conversions the load used, where transformers keeps them: ``save_pretrained``
    reverts them, so the saved keys are the checkpoint's."""
    model._weight_conversions = conversions


# ---------------------------------------------------------------------------------- elixir-run
def replace_get_last_checkpoint(replacement: Callable[[str], str | None]) -> None:
    """``replacement`` in place of transformers' ``get_last_checkpoint``: in
    ``transformers.trainer_utils``, which scripts import it from, and in every module already loaded
    that imported it by name (the Trainer's own module)."""
    from transformers import trainer_utils

    stock = trainer_utils.get_last_checkpoint
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})  # not getattr(module, name): a lazy module would import
        if names.get("get_last_checkpoint") is stock:
            module.get_last_checkpoint = replacement  # type: ignore[attr-defined]


def config_key_taken(key: str) -> None:
    """From now on, TRL's ``TrlParser`` leaves ``key`` of a ``--config`` YAML file out of its arguments
    (elixir-run has read it). Nothing without TRL; once per process."""
    try:
        from trl import TrlParser
    except ImportError:
        return
    stock = TrlParser.set_defaults_with_config
    if getattr(stock, "_elixir", False):
        return

    @functools.wraps(stock)
    def set_defaults_with_config(self: TrlParser, **kwargs: object) -> list[str]:
        kwargs.pop(key, None)
        return stock(self, **kwargs)

    set_defaults_with_config._elixir = True  # type: ignore[attr-defined]
    TrlParser.set_defaults_with_config = set_defaults_with_config  # type: ignore[method-assign]


def construct_elixir(stock: type, elixir_of: Callable[[type], type]) -> None:
    """From now on, ``stock(...)`` and ``Sub(...)`` for every subclass ``Sub`` (defined before or
    after) build an instance of ``elixir_of(Sub)``. ``isinstance(x, Sub)`` stays true; Python calls
    that class's ``__init__`` with the caller's arguments, as it would have called ``Sub``'s."""
    if getattr(stock.__new__, "_elixir", False):
        return

    def __new__(cls: type, *args: object, **kwargs: object) -> object:
        return object.__new__(elixir_of(cls))

    __new__._elixir = True  # type: ignore[attr-defined]
    stock.__new__ = staticmethod(__new__)  # type: ignore[method-assign, assignment]


# ---------------------------------------------------------------------------------- Accelerate
@contextlib.contextmanager
def hidden_from_accelerate(accelerator: _Registries, optimizer: object, model: object = None) -> Iterator[None]:
    """Inside, ``optimizer`` (and ``model``) are out of ``accelerator``'s registries, which its own
    ``save_state``/``load_state`` walk (rank-0 optimizer state, plain-PyTorch weight loading): the
    engine saves and loads them itself. Each is back at its place after."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_out_of(accelerator._optimizers, optimizer))
        if model is not None:
            stack.enter_context(_out_of(accelerator._models, model))
        yield


@contextlib.contextmanager
def _out_of(registry: list[object], obj: object) -> Iterator[None]:
    index = registry.index(obj)
    registry.pop(index)
    try:
        yield
    finally:
        registry.insert(index, obj)


def mark_accelerate_prepared(model: torch.nn.Module) -> None:
    """Accelerate's guard against wrapping a model twice: ``prepare_model`` registers a model so marked
    and returns it as it is (no ``.to()``, DDP, autocast), for the engine places and reduces it."""
    vars(model)["_is_accelerate_prepared"] = True  # a plain attribute (what nn.Module.__setattr__ does with a bool)


def register_optimizer(accelerator: _Registries, optimizer: object) -> None:
    """``optimizer`` (the engine's, wrapped) in ``accelerator``'s registry, as ``prepare_optimizer`` puts
    the ones it wraps: ``optimizer_step_was_skipped`` reads it, and ``save_state``/``load_state`` walk it."""
    accelerator._optimizers.append(optimizer)


def mark_optimizer_stepped(optimizer: _OptCalled) -> None:
    """A scheduler built on ``optimizer`` sees its steps run by the engine (same param_groups): tell
    torch it has stepped, or its "scheduler before optimizer" warning fires."""
    optimizer._opt_called = True
