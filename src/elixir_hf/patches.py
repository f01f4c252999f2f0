"""Every place elixir_hf changes the behaviour of another library, and what each change relies on.

A patch is an object of transformers, accelerate, PEFT or torch that elixir_hf replaces, swaps for
the length of a call, or marks so that the library reads it differently: a module global, a
class's method or constructor, a method on one instance, a private attribute or registry the
library reads. Each is made by one function below, and nowhere else; the rest of elixir_hf
subclasses (``Trainer``, ``TrainingArguments``, ``Accelerator``, ``AcceleratedOptimizer``) and
calls public API. The callers keep what is theirs (what to load, when to rotate); these functions
only reach in.

``PATCHES`` lists them: the object patched, the upstream code that reads it, the function here that
patches it, the versions it was verified against, and what goes wrong, silently, if upstream moves
it. ``tests/elixir_hf/test_patches.py`` holds one contract test per row (the object still exists
with the signature the patch assumes, and its reader still looks it up where it is patched),
failing by the row's name; a function here without a row, a row without a contract, or a patch
made outside this module fails there too. On a new transformers or accelerate: run that file,
then add the version to ``verified``.

The libraries are imported inside the functions, each when its patch is made: importing this module
loads none of them (``loading/`` imports it, and must not pull in the Trainer stack or PEFT).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from unittest import mock

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
    "mark_optimizer_stepped",
    "replace_get_last_checkpoint",
    "save_messages_name",
    "save_pretrained_where_told",
    "trainer_accelerator",
    "weights_recorded_not_read",
]


@dataclass(frozen=True)
class Patch:
    target: str
    """The object patched (a dotted name; ``model.`` / ``optimizer.``: an attribute set on that instance)."""
    read_by: str
    """The upstream code whose behaviour the patch changes: where ``target`` is looked up."""
    by: str
    """The function of this module that patches it."""
    breaks: str
    """What goes wrong, without an error, if upstream moves or renames it."""
    verified: tuple[str, ...]


_TRANSFORMERS = ("transformers 5.17.0", "transformers 5.24.0")
_ACCELERATE = ("accelerate 1.15.0",)

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
        "streamed load then refuses the model; or, where only the stand-in's side effects drift "
        "(_is_hf_initialized, _weight_conversions), transformers re-initialises streamed parameters or "
        "save_pretrained stops reverting the checkpoint's key renames",
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
        ("peft 0.21.2",),
    ),
    Patch(
        "trl.TrlParser.set_defaults_with_config",
        "trl.TrlParser.parse_args_and_config (a --config YAML file's keys)",
        "config_key_taken",
        "under elixir-run, a YAML config's elixir key (read by elixir-run) fails a strict TrlParser as an unknown "
        "argument, or reaches arguments that know the field and beats the command line's --elixir",
        ("trl 1.16.0",),
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
        ("torch 2.13.0",),
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
)


# ---------------------------------------------------------------------------------- the Trainer
@contextlib.contextmanager
def trainer_accelerator(factory: Callable[..., Any]) -> Iterator[None]:
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

    rotations: list[dict[str, Any]] = []

    def rotate() -> None:
        for kwargs in rotations:
            transformers.trainer.rotate_checkpoints(**kwargs)

    with mock.patch.object(transformers.trainer, "rotate_checkpoints", lambda **kw: rotations.append(kw)):
        yield rotate


def save_pretrained_where_told(model: Any) -> contextlib.AbstractContextManager:
    """transformers' ``save_pretrained`` writes on global rank 0 only once torch.distributed is up
    (``should_save_on_this_rank``), whatever ``is_main_process`` says, which leaves the weights off
    every other node under ``save_on_each_node``. Inside, the caller (the Trainer's ``should_save``:
    rank 0, or each node's main process) decides."""
    if not hasattr(model, "should_save_on_this_rank"):
        return contextlib.nullcontext()
    return mock.patch.object(model, "should_save_on_this_rank", lambda is_main_process: is_main_process)


@contextlib.contextmanager
def save_messages_name(stage: str, final: str | Any) -> Iterator[None]:
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
def mask_decisions_of(batch: Any) -> Iterator[None]:
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
    ignore_mask, packed_indices = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices

    def ignore_causal_mask(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if unpadded and padding_mask is not None and is_fake(padding_mask):
            padding_mask = None  # all ones: transformers answers as for no mask
        return ignore_mask(padding_mask, *args, **kwargs)

    def packed_sequence_indices(position_ids: Any) -> Any:
        return None if not packed and is_fake(position_ids) else packed_indices(position_ids)

    with (
        mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa", ignore_causal_mask),
        mock.patch.object(masking_utils, "find_packed_sequence_indices", packed_sequence_indices),
    ):
        yield


# ---------------------------------------------------------------------------------- loading
def weights_recorded_not_read(record: Callable[..., Any]) -> contextlib.AbstractContextManager:
    """Inside, ``from_pretrained`` hands each checkpoint's tensors to ``record`` (same arguments and
    result as transformers' ``convert_and_load_state_dict_in_model``) instead of reading them into the
    parameters."""
    import transformers.modeling_utils

    return mock.patch.object(transformers.modeling_utils, "convert_and_load_state_dict_in_model", record)


def from_pretrained_through(load: Callable[[Callable[..., Any], type, Any, dict[str, Any]], Any]) -> None:
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
            owner.from_pretrained = classmethod(_through(stock, load))  # type: ignore[method-assign, attr-defined]


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


def _through(stock: Callable[..., Any], load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def from_pretrained(cls: Any, name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or name_or_path is None:
            return stock(cls, name_or_path, *args, **kwargs)
        return load(functools.partial(stock, cls), cls, name_or_path, kwargs)

    from_pretrained._elixir = True  # type: ignore[attr-defined]
    return from_pretrained


def before_inject_adapter(hook: Callable[[Any], None]) -> None:
    """From now on, PEFT's ``BaseTuner.inject_adapter(model, ...)`` (which ``get_peft_model`` and TRL's
    ``peft_config`` reach) runs ``hook(model)`` first. Nothing without PEFT; once per process."""
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return
    stock = BaseTuner.inject_adapter
    if getattr(stock, "_elixir", False):
        return

    @functools.wraps(stock)
    def inject_adapter(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        hook(model)
        return stock(self, model, *args, **kwargs)

    inject_adapter._elixir = True  # type: ignore[attr-defined]
    BaseTuner.inject_adapter = inject_adapter  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------- elixir-run
def replace_get_last_checkpoint(replacement: Callable[[Any], str | None]) -> None:
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
    def set_defaults_with_config(self: Any, **kwargs: Any) -> list[str]:
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

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(elixir_of(cls))

    __new__._elixir = True  # type: ignore[attr-defined]
    stock.__new__ = staticmethod(__new__)  # type: ignore[method-assign, assignment]


# ---------------------------------------------------------------------------------- Accelerate
@contextlib.contextmanager
def hidden_from_accelerate(accelerator: Any, optimizer: Any, model: Any = None) -> Iterator[None]:
    """Inside, ``optimizer`` (and ``model``) are out of ``accelerator``'s registries, which its own
    ``save_state``/``load_state`` walk (rank-0 optimizer state, plain-PyTorch weight loading): the
    engine saves and loads them itself. Each is back at its place after."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_out_of(accelerator._optimizers, optimizer))
        if model is not None:
            stack.enter_context(_out_of(accelerator._models, model))
        yield


@contextlib.contextmanager
def _out_of(registry: list, obj: Any) -> Iterator[None]:
    index = registry.index(obj)
    registry.pop(index)
    try:
        yield
    finally:
        registry.insert(index, obj)


def mark_accelerate_prepared(model: Any) -> None:
    """Accelerate's guard against wrapping a model twice: ``prepare_model`` registers a model so marked
    and returns it as it is (no ``.to()``, DDP, autocast), for the engine places and reduces it."""
    model._is_accelerate_prepared = True


def mark_optimizer_stepped(optimizer: Any) -> None:
    """A scheduler built on ``optimizer`` sees its steps run by the engine (same param_groups): tell
    torch it has stepped, or its "scheduler before optimizer" warning fires."""
    optimizer._opt_called = True
