"""A contract per patch of ``elixir_hf/patches.py``: what each one replaces still exists with the
signature it assumes, and the upstream code still looks it up where it is patched. A test id is the
patched object, so an upgrade of transformers, accelerate, PEFT or torch that moves one fails by its
name (``PATCHES`` says what would otherwise break without an error). Static: sources, signatures and
bytecode are read, nothing is trained or built. Also: every patch function has a row, every row a
contract, and no module of elixir_hf but ``patches.py`` reaches into a library."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import dis
import inspect
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elixir_hf import patches
from elixir_hf.patches import PATCHES, Patch

SRC = Path(__file__).resolve().parents[2] / "src" / "elixir_hf"


# ---------------------------------------------------------------------------------- reading upstream code
def _tree(fn: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))


def _globals(fn: Any) -> set[str]:
    """The module globals ``fn`` (and the functions nested in it) looks up when it runs."""
    names, todo = set(), [inspect.unwrap(fn).__code__]
    while todo:
        code = todo.pop()
        names |= {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        todo += [c for c in code.co_consts if inspect.iscode(c)]
    return names


def _calls(fn: Any, name: str) -> list[ast.Call]:
    """Calls in ``fn``'s source of ``name(...)`` or ``x.name(...)``."""
    return [
        node
        for node in ast.walk(_tree(fn))
        if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
    ]


def _on(call: ast.Call, owner: str) -> bool:
    """``owner.name(...)``: looked up on that object (where an instance attribute or a class patch wins)."""
    return isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == owner


def _self_attributes(fn: Any) -> set[str]:
    return {
        node.attr
        for node in ast.walk(_tree(fn))
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self"
    }


def _bindable(fn: Any, call: ast.Call, skip: int = 0) -> None:
    """``fn`` accepts the arguments of ``call`` (by position and keyword); ``skip``: leading
    parameters bound already (a partial's)."""
    positional = [None] * (skip + len(call.args))
    inspect.signature(fn).bind(*positional, **{k.arg: None for k in call.keywords if k.arg})


# ---------------------------------------------------------------------------------- one contract per row
def _trainer_accelerator() -> None:
    import accelerate
    import transformers.trainer

    assert transformers.trainer.Accelerator is accelerate.Accelerator, (
        "transformers.trainer.Accelerator is not accelerate's"
    )
    assert "Accelerator" in _globals(transformers.Trainer.create_accelerator_and_postprocess), (
        "Trainer.create_accelerator_and_postprocess no longer builds its Accelerator through the module global"
    )


def _rotate_checkpoints() -> None:
    import transformers.trainer

    save = transformers.Trainer._save_checkpoint
    assert "rotate_checkpoints" in _globals(save), "Trainer._save_checkpoint no longer calls the module global"
    calls = _calls(save, "rotate_checkpoints")
    assert calls and all(not c.args for c in calls), "rotate_checkpoints is called with positional arguments"
    for call in calls:  # the recorder takes **kwargs and hands them to the stock function later
        _bindable(transformers.trainer.rotate_checkpoints, call)


def _should_save_on_this_rank() -> None:
    from transformers import PreTrainedModel

    assert list(inspect.signature(PreTrainedModel.should_save_on_this_rank).parameters) == ["self", "is_main_process"]
    calls = [c for c in _calls(PreTrainedModel.save_pretrained, "should_save_on_this_rank") if _on(c, "self")]
    assert calls, "save_pretrained no longer asks self.should_save_on_this_rank(...)"
    for call in calls:
        _bindable(lambda is_main_process: None, call)


def _convert_and_load_state_dict_in_model() -> None:
    import transformers.modeling_utils as modeling_utils
    from transformers.utils.loading_report import LoadStateDictInfo

    from elixir_hf.loading import stream

    loader = modeling_utils.PreTrainedModel._load_pretrained_model
    assert "convert_and_load_state_dict_in_model" in _globals(loader), (
        "_load_pretrained_model no longer reads the tensors through the modeling_utils global"
    )
    stock = modeling_utils.convert_and_load_state_dict_in_model
    assert list(inspect.signature(stock).parameters) == list(inspect.signature(stream._record).parameters)[1:], (
        "its parameters changed: loading/stream.py's _record must take the same"
    )
    for call in _calls(loader, "convert_and_load_state_dict_in_model"):
        _bindable(stream._record, call, skip=1)  # keys: the partial's
    (info,) = _calls(stream._record, "LoadStateDictInfo")
    assert {k.arg for k in info.keywords} == {f.name for f in dataclasses.fields(LoadStateDictInfo)}


def _is_hf_initialized() -> None:
    from transformers import initialization

    source = inspect.getsource(initialization)
    assert 'getattr(tensor, "_is_hf_initialized", False)' in source, "the init functions no longer check the mark"


def _weight_conversions() -> None:
    from transformers import core_model_loading

    revert = core_model_loading.revert_weight_conversion
    assert 'getattr(model, "_weight_conversions"' in inspect.getsource(revert), "the revert no longer reads it"
    assert "_weight_conversions" in inspect.getsource(core_model_loading.convert_and_load_state_dict_in_model)


def _from_pretrained() -> None:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    method = PreTrainedModel.__dict__["from_pretrained"]
    assert isinstance(method, classmethod), "PreTrainedModel.from_pretrained is no classmethod"
    params = list(inspect.signature(inspect.unwrap(method.__func__)).parameters.values())
    assert params[1].name == "pretrained_model_name_or_path" and params[1].kind is params[1].POSITIONAL_OR_KEYWORD
    assert params[-1].kind is params[-1].VAR_KEYWORD
    for cls in (GPT2LMHeadModel, LlamaForCausalLM):  # inherited, so the patch on PreTrainedModel reaches them
        assert "from_pretrained" not in vars(cls), f"{cls.__name__} defines its own from_pretrained"
    assert any(_on(c, "model_class") for c in _calls(_BaseAutoModelClass.from_pretrained, "from_pretrained")), (
        "the Auto classes no longer call model_class.from_pretrained"
    )


def _auto_from_pretrained() -> None:
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    method = _BaseAutoModelClass.__dict__["from_pretrained"]
    assert isinstance(method, classmethod), "_BaseAutoModelClass.from_pretrained is no classmethod"
    params = list(inspect.signature(method.__func__).parameters.values())
    assert params[1].name == "pretrained_model_name_or_path" and params[1].kind is params[1].POSITIONAL_OR_KEYWORD
    assert params[-1].kind is params[-1].VAR_KEYWORD
    autos = patches._copies_of(_BaseAutoModelClass, "from_pretrained")
    for name in ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForSeq2SeqLM"):
        assert getattr(transformers, name) in autos, f"{name}.from_pretrained is no copy of the base's"


def _inject_adapter() -> None:
    pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTuner

    assert list(inspect.signature(inspect.unwrap(BaseTuner.inject_adapter)).parameters)[:2] == ["self", "model"]
    calls = [c for c in _calls(BaseTuner.__init__, "inject_adapter") if _on(c, "self")]
    assert calls, "BaseTuner.__init__ no longer injects through self.inject_adapter"
    assert all(c.args or any(k.arg == "model" for k in c.keywords) for c in calls)  # the hook gets the model


def _set_defaults_with_config() -> None:
    pytest.importorskip("trl")
    from trl import TrlParser

    assert list(inspect.signature(inspect.unwrap(TrlParser.set_defaults_with_config)).parameters) == ["self", "kwargs"]
    calls = [c for c in _calls(TrlParser.parse_args_and_config, "set_defaults_with_config") if _on(c, "self")]
    assert calls and all(any(k.arg is None for k in c.keywords) for c in calls)  # the YAML mapping as **config


def _get_last_checkpoint() -> None:
    from transformers import trainer_utils

    from elixir_hf.checkpoint import restart

    assert trainer_utils.get_last_checkpoint in (restart._STOCK, restart.get_last_checkpoint)
    assert list(inspect.signature(restart._STOCK).parameters) == ["folder"]
    assert trainer_utils.PREFIX_CHECKPOINT_DIR == "checkpoint"  # the checkpoint-N folders restart reads


def _constructed(stock_name: str, subclasses: tuple[tuple[str, str], ...]) -> Callable[[], None]:
    """``stock`` and its subclasses build through ``object.__new__`` (or already through the patch's):
    the patch's ``__new__`` replaces nobody's."""

    def contract() -> None:
        import importlib

        stock = getattr(importlib.import_module(stock_name.rsplit(".", 1)[0]), stock_name.rsplit(".", 1)[1])
        classes = [stock]
        for module, name in subclasses:
            classes.append(getattr(pytest.importorskip(module), name))
        for cls in classes:
            own = [c.__name__ for c in cls.__mro__[:-1] if "__new__" in vars(c) and not _ours(vars(c)["__new__"])]
            assert not own, f"{cls.__name__}'s MRO defines __new__: {own}"

    return contract


def _ours(new: Any) -> bool:
    return getattr(getattr(new, "__func__", new), "_elixir", False)


def _registry(name: str, readers: tuple[str, ...], appended: bool = False) -> Callable[[], None]:
    def contract() -> None:
        from accelerate import Accelerator

        assert name in _self_attributes(Accelerator.__init__)
        for reader in readers:
            method = getattr(Accelerator, reader)
            assert name in _self_attributes(getattr(method, "fget", method)), (
                f"Accelerator.{reader} no longer walks {name}"
            )
        if appended:  # register_optimizer does what prepare_optimizer does with the ones it wraps
            calls = [c for c in _calls(Accelerator.prepare_optimizer, "append") if name in ast.unparse(c.func)]
            assert calls, f"prepare_optimizer no longer registers what it wraps in {name}"

    return contract


def _is_accelerate_prepared() -> None:
    from accelerate import Accelerator

    guards = [
        node
        for node in ast.walk(_tree(Accelerator.prepare_model))
        if isinstance(node, ast.If) and "_is_accelerate_prepared" in ast.unparse(node.test)
    ]
    assert guards, "prepare_model no longer checks _is_accelerate_prepared"
    assert any(isinstance(s, ast.Return) and ast.unparse(s.value) == "model" for g in guards for s in g.body), (
        "prepare_model no longer returns a model marked _is_accelerate_prepared as it is"
    )


def _opt_called() -> None:
    from torch.optim.lr_scheduler import LRScheduler

    assert '"_opt_called"' in inspect.getsource(LRScheduler.step), "LRScheduler.step no longer reads _opt_called"


def _save_messages() -> None:
    import transformers.modeling_utils
    import transformers.trainer
    from transformers.utils import logging as hf_logging

    assert hf_logging.get_logger("transformers").name == "transformers"
    for module in (transformers.trainer, transformers.modeling_utils):  # their records reach its handlers
        assert module.logger.name.startswith("transformers."), module.logger.name
    assert "Saving model checkpoint to {output_dir}" in inspect.getsource(transformers.Trainer._save)
    assert "Model weights saved in" in inspect.getsource(transformers.PreTrainedModel.save_pretrained)


def _mask_decision(name: str, reader: str, parameters: tuple[str, ...]) -> Callable[[], None]:
    """``masking_utils.<name>`` takes ``parameters`` first, and ``masking_utils.<reader>`` calls it through
    the module global with its first argument (the tensor the patch checks for fakeness) first."""

    def contract() -> None:
        from transformers import masking_utils

        params = tuple(inspect.signature(getattr(masking_utils, name)).parameters)
        assert params[: len(parameters)] == parameters, f"masking_utils.{name}{params}"
        read = getattr(masking_utils, reader)
        assert name in _globals(read), f"masking_utils.{reader} no longer calls {name} through the module global"
        for call in _calls(read, name):
            _bindable(getattr(masking_utils, name), call)

    return contract


def _elixir(place: str) -> Any:
    """``module.qualified_name`` inside ``elixir_hf``: the object (the longest importable module, then attributes)."""
    import importlib

    parts = place.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["elixir_hf", *parts[:i]]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"elixir_hf.{place}")


def _overridden(owner: str, name: str, callers: tuple[str, ...]) -> Callable[[], None]:
    """``owner.name`` (a library's private method) takes the parameters of elixir_hf's override, and each
    of ``callers`` (methods of ``owner``) still calls ``self.name(...)`` with arguments it binds."""

    def contract() -> None:
        stock = getattr(_library(owner), name)
        patch = next(p for p in PATCHES if p.target == f"{owner}.{name}")
        ours = _elixir(patch.by)
        assert list(inspect.signature(stock).parameters) == list(inspect.signature(ours).parameters), (
            f"{owner}.{name}{inspect.signature(stock)}: the override takes {inspect.signature(ours)}"
        )
        for caller in callers:
            calls = [c for c in _calls(getattr(_library(owner), caller), name) if _on(c, "self")]
            assert calls, f"{owner}.{caller} no longer calls self.{name}"
            for call in calls:
                _bindable(ours, call, skip=1)

    return contract


def _library(dotted: str) -> Any:
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _valid_dict_fields() -> None:
    from transformers import TrainingArguments

    assert all(isinstance(f, str) for f in TrainingArguments._VALID_DICT_FIELDS)
    assert "_VALID_DICT_FIELDS" in _self_attributes(TrainingArguments.__post_init__), "__post_init__ no longer reads it"


def _precompute_ref_logps() -> None:
    trl = pytest.importorskip("trl")

    for name in ("DPOTrainer", "KTOTrainer"):
        cls = getattr(trl, name, None)
        if cls is None:
            continue
        assert callable(cls._precompute_ref_logps), f"{name}._precompute_ref_logps"
        assert "_precompute_ref_logps" in _self_attributes(cls.__init__), f"{name}.__init__ no longer precomputes"


def _get_output_dir() -> None:
    from transformers import Trainer

    assert list(inspect.signature(Trainer._get_output_dir).parameters) == ["self", "trial"]
    calls = [c for c in _calls(Trainer._save_checkpoint, "_get_output_dir") if _on(c, "self")]
    assert calls, "Trainer._save_checkpoint no longer names its folder by _get_output_dir"


def _save() -> None:
    from transformers import Trainer

    assert list(inspect.signature(Trainer._save).parameters)[:3] == ["self", "output_dir", "state_dict"]
    assert [c for c in _calls(Trainer.save_model, "_save") if _on(c, "self")], "save_model no longer writes by _save"


def _train_batch_size() -> None:
    from transformers import Trainer

    assert "_train_batch_size" in _self_attributes(Trainer.__init__)
    assert "_train_batch_size" in _self_attributes(Trainer.get_train_dataloader), "the dataloader's batch is another"


def _n_gpu() -> None:
    from transformers import TrainingArguments

    assert "_n_gpu" in _self_attributes(TrainingArguments.n_gpu.fget), "TrainingArguments.n_gpu no longer reads it"
    assert "self._n_gpu =" in inspect.getsource(TrainingArguments), "TrainingArguments no longer sets it"


def _original_sigterm_handler() -> None:
    from transformers import trainer_jit_checkpoint as jit

    assert "_original_sigterm_handler" in _self_attributes(jit.CheckpointManager.setup_signal_handler)
    assert "jit_manager" in _self_attributes(jit.JITCheckpointCallback.__init__)
    assert jit.JITCheckpointCallback.__name__ == "JITCheckpointCallback"  # trainer._drop_jit_checkpoint's match


def _from_config() -> None:
    from transformers import PreTrainedModel

    method = PreTrainedModel.__dict__["_from_config"]
    assert isinstance(method, classmethod), "PreTrainedModel._from_config is no classmethod"
    params = list(inspect.signature(method.__func__).parameters.values())
    assert params[1].name == "config" and params[-1].kind is params[-1].VAR_KEYWORD


def _shared_state() -> None:
    from accelerate import PartialState

    assert "_shared_state" in vars(PartialState) and "_shared_state" in _self_attributes(PartialState.__init__)
    assert isinstance(bool(PartialState._shared_state), bool)


def _set_pg_timeout() -> None:
    from torch.distributed import distributed_c10d

    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters) == ["timeout", "group"]


def _log_softmax_backward_data() -> None:
    import torch

    x = torch.randn(3, 7, requires_grad=True)
    y = torch.log_softmax(x, 1)
    grad = torch.randn(3, 7)
    (expected,) = torch.autograd.grad(y, x, grad)
    out = torch._log_softmax_backward_data(grad, y.detach(), 1, torch.float32)
    torch.testing.assert_close(out, expected)


def _dataset_indices() -> None:
    datasets = pytest.importorskip("datasets")
    from elixir_hf.batch_plan import _arrow_lengths

    selected = datasets.Dataset.from_dict({"input_ids": [[1], [1, 2], [1, 2, 3]]}).select([2, 0])
    assert selected._indices.column(0).to_pylist() == [2, 0]
    assert list(_arrow_lengths(selected)) == [3, 1]


CONTRACTS: dict[str, Callable[[], None]] = {
    "transformers.trainer.Accelerator": _trainer_accelerator,
    "transformers.trainer.rotate_checkpoints": _rotate_checkpoints,
    "model.should_save_on_this_rank": _should_save_on_this_rank,
    "transformers.modeling_utils.convert_and_load_state_dict_in_model": _convert_and_load_state_dict_in_model,
    "transformers.PreTrainedModel.from_pretrained": _from_pretrained,
    "transformers.models.auto.auto_factory._BaseAutoModelClass.from_pretrained": _auto_from_pretrained,
    "peft.tuners.tuners_utils.BaseTuner.inject_adapter": _inject_adapter,
    "trl.TrlParser.set_defaults_with_config": _set_defaults_with_config,
    "transformers.trainer_utils.get_last_checkpoint": _get_last_checkpoint,
    "transformers.TrainingArguments.__new__": _constructed("transformers.TrainingArguments", (("trl", "SFTConfig"),)),
    "transformers.Trainer.__new__": _constructed("transformers.Trainer", (("trl", "SFTTrainer"),)),
    "accelerate.Accelerator.__new__": _constructed("accelerate.Accelerator", ()),
    "accelerate.Accelerator._optimizers": _registry(
        "_optimizers", ("save_state", "load_state", "optimizer_step_was_skipped", "free_memory"), appended=True
    ),
    "accelerate.Accelerator._models": _registry("_models", ("load_state",)),
    "tensor._is_hf_initialized": _is_hf_initialized,
    "model._weight_conversions": _weight_conversions,
    "model._is_accelerate_prepared": _is_accelerate_prepared,
    "optimizer._opt_called": _opt_called,
    "the handlers of the 'transformers' logger (and the root logger's)": _save_messages,
    "transformers.masking_utils._ignore_causal_mask_sdpa": _mask_decision(
        "_ignore_causal_mask_sdpa", "sdpa_mask", ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset")
    ),
    "transformers.masking_utils.find_packed_sequence_indices": _mask_decision(
        "find_packed_sequence_indices", "_preprocess_mask_arguments", ("position_ids",)
    ),
    "transformers.Trainer._save_checkpoint": _overridden(
        "transformers.Trainer", "_save_checkpoint", ("_maybe_log_save_evaluate",)
    ),
    "transformers.Trainer._save_optimizer_and_scheduler": _overridden(
        "transformers.Trainer", "_save_optimizer_and_scheduler", ("_save_checkpoint",)
    ),
    "transformers.Trainer._load_from_checkpoint": _overridden(
        "transformers.Trainer", "_load_from_checkpoint", ("_prepare_for_training",)
    ),
    "transformers.Trainer._load_optimizer_and_scheduler": _overridden(
        "transformers.Trainer", "_load_optimizer_and_scheduler", ("_prepare_for_training",)
    ),
    "transformers.TrainingArguments._VALID_DICT_FIELDS": _valid_dict_fields,
    "trl.DPOTrainer._precompute_ref_logps": _precompute_ref_logps,
    "transformers.Trainer._get_output_dir": _get_output_dir,
    "transformers.Trainer._save": _save,
    "transformers.Trainer._train_batch_size": _train_batch_size,
    "transformers.TrainingArguments._n_gpu": _n_gpu,
    "transformers.trainer_jit_checkpoint.CheckpointManager._original_sigterm_handler": _original_sigterm_handler,
    "transformers.PreTrainedModel._from_config": _from_config,
    "accelerate.PartialState._shared_state": _shared_state,
    "torch.distributed.distributed_c10d._set_pg_timeout": _set_pg_timeout,
    "torch._log_softmax_backward_data": _log_softmax_backward_data,
    "datasets.Dataset._indices": _dataset_indices,
}


@pytest.mark.parametrize("patch", PATCHES, ids=[f"{p.target} ({p.by})" for p in PATCHES])
def test_the_patched_object_is_where_the_patch_assumes(patch: Patch) -> None:
    contract = CONTRACTS.get(patch.target)
    assert contract is not None, f"{patch.target} ({patch.by}) has no contract here: write one"
    try:
        contract()
    except (AssertionError, AttributeError, ImportError, KeyError, TypeError, OSError, StopIteration) as exc:
        pytest.fail(
            f"{patch.target}, read by {patch.read_by}, relied on by {patch.by} ({patch.kind}), moved upstream: "
            f"{type(exc).__name__}: {exc}\nwithout it: {patch.breaks}"
        )


def test_every_contract_is_of_a_patch() -> None:
    assert set(CONTRACTS) == {p.target for p in PATCHES}


def test_every_patch_function_has_a_row() -> None:
    functions = {
        name
        for name, f in inspect.getmembers(patches, inspect.isfunction)
        if f.__module__ == patches.__name__ and not name.startswith("_")
    }
    assert functions == {p.by for p in PATCHES if p.kind == "patch"}
    assert set(patches.__all__) == functions | {"PATCHES", "Patch"}
    assert all(p.target and p.read_by and p.breaks and p.verified for p in PATCHES)
    assert {p.kind for p in PATCHES} <= {"patch", "override", "read"}
    assert len({(p.target, p.by) for p in PATCHES}) == len(PATCHES), "a row twice"


def _places(patch: Patch) -> list[str]:
    return [] if patch.kind == "patch" else patch.by.split(", ")


@pytest.mark.parametrize("place", sorted({place for p in PATCHES for place in _places(p)}))
def test_every_place_a_row_names_exists(place: str) -> None:
    """An override's or a read's ``by`` names code of elixir_hf that exists (a renamed one is renamed there)."""
    _elixir(place)


# ---------------------------------------------------------------------------------- the versions verified
def _installed(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package).split("+")[0]  # torch's local tag (+cpu, +cu130) aside
    except metadata.PackageNotFoundError:
        return None


def test_the_installed_versions_are_verified() -> None:
    """Each library a row relies on is installed at a version every row about it was verified on: an
    upgrade fails here, naming the package and the version, until the contracts pass on it and
    ``patches.py`` adds it."""
    verified: dict[str, set[str]] = {}
    for patch in PATCHES:
        by_package: dict[str, set[str]] = {}
        for entry in patch.verified:
            package, version = entry.split()
            by_package.setdefault(package, set()).add(version)
        for package, versions in by_package.items():  # the versions every row agrees on
            verified[package] = verified[package] & versions if package in verified else versions
    outside = [
        f"{package} {version} (verified: {', '.join(sorted(verified[package]))})"
        for package in sorted(verified)
        if (version := _installed(package)) is not None and version not in verified[package]
    ]
    assert not outside, (
        f"installed outside patches.py's verified versions: {'; '.join(outside)}. Run tests/elixir_hf/test_patches.py "
        "on it, fix what moved, then add the version to patches.py's constants"
    )
    assert {"transformers", "accelerate", "peft", "trl", "torch"} <= set(verified)


# ---------------------------------------------------------------------------------- overrides
def _library_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__[1:] if c.__module__.split(".")[0] in LIBRARIES]


def _elixir_classes() -> list[type]:
    import importlib
    import pkgutil

    import elixir_hf

    for info in pkgutil.walk_packages(elixir_hf.__path__, "elixir_hf."):
        if not info.name.endswith(".__main__"):  # a command's, which runs it
            importlib.import_module(info.name)
    return sorted(
        (
            obj
            for module in list(sys.modules.values())
            if getattr(module, "__name__", "").split(".")[0] == "elixir_hf"
            for obj in vars(module).values()
            if isinstance(obj, type) and obj.__module__ == module.__name__ and _library_bases(obj)
        ),
        key=lambda c: f"{c.__module__}.{c.__qualname__}",
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(cls: type) -> tuple[set[str], set[str]]:
    """What ``cls``'s source defines in its body (methods, class attributes; not what a metaclass adds, as
    torch's ``Function`` its ``_backward_cls``), and what its methods set on ``self``."""
    (body,) = _tree(cls).body
    assert isinstance(body, ast.ClassDef)
    defined = set()
    for node in body.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    set_on_self = {
        n.attr
        for n in ast.walk(body)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", None) == "self"
    }
    return defined, set_on_self


def test_every_private_override_is_a_row() -> None:
    """A private name an elixir_hf subclass defines (a method, a class attribute) that a library base has
    too replaces the library's: it is a row naming the class or the method (or it is renamed, if it
    collides by chance). A private attribute of the library's set on ``self`` is a write: patches.py's."""
    rows = {(p.target.rsplit(".", 1)[-1], place) for p in PATCHES if p.kind == "override" for place in _places(p)}
    overrides, writes = [], []
    for cls in _elixir_classes():
        place = f"{cls.__module__.removeprefix('elixir_hf.')}.{cls.__qualname__}"
        bases = _library_bases(cls)
        theirs = {name for base in bases for name in vars(base)}
        for base in bases:
            with contextlib.suppress(OSError, TypeError):
                theirs |= _self_attributes(base)
        defined, set_on_self = _defined(cls)
        for name in sorted(n for n in defined & theirs if _private(n)):
            if not {(name, place), (name, f"{place}.{name}")} & rows:
                overrides.append(f"{place}.{name}")
        writes += [f"{place}: self.{name} = ..." for name in sorted(set_on_self & theirs) if _private(name)]
    assert not overrides, (
        f"private names of a library base replaced, not in patches.PATCHES (kind='override'): {overrides}"
    )
    assert not writes, f"private attributes of a library base written: make them through patches.py: {writes}"


# ---------------------------------------------------------------------------------- nowhere else
LIBRARIES = {"transformers", "accelerate", "peft", "trl", "torch", "datasets", "safetensors", "huggingface_hub"}


def _reaches_in(path: Path) -> list[str]:
    """What ``path`` patches: ``mock.patch``/``mock.patch.object``, ``setattr``, a ``__new__`` or
    ``__class__`` assigned, or an attribute assigned on a name imported from a library. (Patching
    ``os.environ`` with ``mock.patch.dict`` is no library's behaviour.)"""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in LIBRARIES:
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("setattr", "mock.patch", "mock.patch.object", "patch", "patch.object"):
                found.append((node.lineno, f"{name}(...)"))
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if target.attr in ("__new__", "__class__") or getattr(root, "id", None) in imported:
                found.append((node.lineno, f"{ast.unparse(target)} = ..."))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_module_but_patches_reaches_into_a_library() -> None:
    found = {
        str(p.relative_to(SRC)): hits
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "patches.py" and (hits := _reaches_in(p))
    }
    assert not found, f"patch these through elixir_hf/patches.py (a function, a PATCHES row, a contract): {found}"


def test_the_scan_sees_a_patch(tmp_path: Path) -> None:
    """The scan finds each kind of patch (a scan that finds nothing passes vacuously)."""
    source = tmp_path / "m.py"
    source.write_text(
        "import transformers.trainer\nfrom peft.tuners.tuners_utils import BaseTuner\nfrom unittest import mock\n"
        "BaseTuner.inject_adapter = None\ntransformers.trainer.Accelerator = None\nsetattr(BaseTuner, 'x', 1)\n"
        "mock.patch.object(transformers.trainer, 'rotate_checkpoints', None)\ncls.__new__ = None\n"
    )
    assert [hit.split(":")[0] for hit in _reaches_in(source)] == [f"line {n}" for n in (4, 5, 6, 7, 8)]


# ---------------------------------------------------------------------------------- private names of libraries
MUTATING = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard", "popitem"}
"""Methods that change the container they are called on (``x._registry.append(...)`` writes ``_registry``)."""

STANDARD_LIBRARY = {"_exit": "os._exit, documented", "_actions": "argparse's actions, what --run checks"}
"""Private names of the standard library elixir_hf reads (not versioned apart from Python)."""

OURS_ON_OTHERS = {"_elixir": "elixir_runtime.prepare's state on the model (api.py), and the patches' mark"}
"""Private names this repository sets on objects of other libraries, and reads back."""


def _ours() -> set[str]:
    """The private names this repository defines: functions, classes and globals, class attributes, and
    what its methods set on ``self``/``cls``."""
    names = set(OURS_ON_OTHERS)
    for path in (SRC.parent).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if getattr(node.value, "id", None) in ("self", "cls"):
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def _private_uses(path: Path, ours: set[str]) -> list[tuple[int, str, bool]]:
    """``(line, name, written)`` of each private name of another library ``path`` reaches: an attribute
    not in ``ours``, read, or written (assigned, deleted, item-assigned, or changed by a ``MUTATING``
    call), and a private name imported from a library."""
    tree = ast.parse(path.read_text())
    written: set[int] = set()  # id() of the attribute nodes written through
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):  # x._registry[k] = v
                target = target.value
            if isinstance(target, ast.Attribute):
                written.add(id(target))
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
            uses.append((node.lineno, node.attr, id(node) in written))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in LIBRARIES:
            uses += [(node.lineno, a.name, False) for a in node.names if _private(a.name)]
    return sorted(u for u in uses if u[1] not in STANDARD_LIBRARY)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts)


def test_no_module_but_patches_writes_a_private_attribute_of_a_library() -> None:
    ours = _ours()
    found = {
        _module(p): [f"line {line}: {name}" for line, name, written in uses if written]
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "patches.py" and (uses := _private_uses(p, ours))
    }
    found = {module: hits for module, hits in found.items() if hits}
    assert not found, f"write these through a function of elixir_hf/patches.py (a PATCHES row, a contract): {found}"


def test_every_private_name_of_a_library_read_is_a_row() -> None:
    """A private name of another library read in a module of elixir_hf is a row naming a place in that module."""
    ours = _ours()
    rows: dict[str, set[str]] = {}
    for patch in PATCHES:
        rows.setdefault(patch.target.rsplit(".", 1)[-1], set()).update(_places(patch))
    missing = [
        f"{_module(p)}:{line}: {name}"
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "patches.py"
        for line, name, _ in _private_uses(p, ours)
        if not any(place.startswith(f"{_module(p)}.") for place in rows.get(name, ()))
    ]
    assert not missing, f"add a row to patches.PATCHES (kind='read', by naming the place), with a contract: {missing}"


def test_the_scan_sees_a_private_name(tmp_path: Path) -> None:
    """The scan tells reads from writes, and ours from a library's (a scan that finds nothing passes vacuously)."""
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n    def f(self, acc, model, t):\n        self._mine = 1\n        acc._optimizers.append(1)\n"
        "        model._buffers['x'] = t\n        t._hf = True\n        return acc._models, self._mine\n"
    )
    assert _private_uses(source, {"_mine"}) == [
        (4, "_optimizers", True),
        (5, "_buffers", True),
        (6, "_hf", True),
        (7, "_models", False),
    ]
