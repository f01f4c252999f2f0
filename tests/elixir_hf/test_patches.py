"""A contract per patch of ``elixir_hf/patches.py``: what each one replaces still exists with the
signature it assumes, and the upstream code still looks it up where it is patched. A test id is the
patched object, so an upgrade of transformers, accelerate, PEFT or torch that moves one fails by its
name (``PATCHES`` says what would otherwise break without an error). Static: sources, signatures and
bytecode are read, nothing is trained or built. Also: every patch function has a row, every row a
contract, and no module of elixir_hf but ``patches.py`` reaches into a library."""

from __future__ import annotations

import ast
import dataclasses
import dis
import inspect
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
    from transformers import core_model_loading, initialization
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
    # what the stand-in does in its place, which transformers reads back
    assert 'getattr(model, "_weight_conversions"' in inspect.getsource(core_model_loading)
    assert "_is_hf_initialized" in inspect.getsource(initialization)
    (info,) = _calls(stream._record, "LoadStateDictInfo")
    assert {k.arg for k in info.keywords} == {f.name for f in dataclasses.fields(LoadStateDictInfo)}


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


def _registry(name: str, readers: tuple[str, ...]) -> Callable[[], None]:
    def contract() -> None:
        from accelerate import Accelerator

        assert name in _self_attributes(Accelerator.__init__)
        for reader in readers:
            assert name in _self_attributes(getattr(Accelerator, reader)), (
                f"Accelerator.{reader} no longer walks {name}"
            )

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
    "accelerate.Accelerator._optimizers": _registry("_optimizers", ("save_state", "load_state")),
    "accelerate.Accelerator._models": _registry("_models", ("load_state",)),
    "model._is_accelerate_prepared": _is_accelerate_prepared,
    "optimizer._opt_called": _opt_called,
    "the handlers of the 'transformers' logger (and the root logger's)": _save_messages,
    "transformers.masking_utils._ignore_causal_mask_sdpa": _mask_decision(
        "_ignore_causal_mask_sdpa", "sdpa_mask", ("padding_mask", "q_length", "kv_length", "q_offset", "kv_offset")
    ),
    "transformers.masking_utils.find_packed_sequence_indices": _mask_decision(
        "find_packed_sequence_indices", "_preprocess_mask_arguments", ("position_ids",)
    ),
}


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_the_patched_object_is_where_the_patch_assumes(patch: Patch) -> None:
    contract = CONTRACTS.get(patch.target)
    assert contract is not None, f"{patch.target} ({patch.by}) has no contract here: write one"
    try:
        contract()
    except (AssertionError, AttributeError, ImportError, KeyError, TypeError, OSError) as exc:
        pytest.fail(
            f"{patch.target}, read by {patch.read_by}, patched by patches.{patch.by}, moved upstream: "
            f"{type(exc).__name__}: {exc}\nwithout the patch: {patch.breaks}"
        )


def test_every_contract_is_of_a_patch() -> None:
    assert set(CONTRACTS) == {p.target for p in PATCHES}


def test_every_patch_function_has_a_row() -> None:
    functions = {
        name
        for name, f in inspect.getmembers(patches, inspect.isfunction)
        if f.__module__ == patches.__name__ and not name.startswith("_")
    }
    assert functions == {p.by for p in PATCHES}
    assert set(patches.__all__) == functions | {"PATCHES", "Patch"}
    assert all(p.target and p.read_by and p.breaks and p.verified for p in PATCHES)


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
