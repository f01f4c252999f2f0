"""``from_pretrained`` with the weights left in their safetensors files, for the engine to stream.

transformers' own ``from_pretrained`` runs unchanged (config and its overrides, ``dtype``
resolution, the model built on meta, key renames and the base-model prefix, tied weights,
non-persistent buffers initialised, ``eval()``, the generation config) except for one step: where
it would read each tensor into its parameter, ``_record`` only notes which checkpoint key holds
which parameter. The parameters stay on meta on every rank, the model carries the files
(``elixir_runtime.stream_weights``) and ``prepare`` reads each rank's shards from them.

[Note: what cannot be streamed]
A checkpoint that is not a safetensors folder (``pytorch_model.bin``, a PEFT adapter folder; a Hub
id is its snapshot folder in the cache: ``hub.py``), loading options that change how tensors are
read (``device_map``, quantisation, ``variant``, ...), a key that transformers converts rather than renames (fused or split tensors,
``WeightConverter``) and ``keep_in_fp32`` modules under a half dtype: ``streaming_blocker`` or
``CannotStream`` says which, and ``model.from_pretrained`` loads without streaming, with a
warning. A parameter the checkpoint lacks (transformers would initialise it at random) is a
``WeightsError``: the checkpoint is incomplete or for another model.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils.loading_report import LoadStateDictInfo

from elixir_runtime import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointFiles,
    WeightsError,
    attached_weights,
    detach_weights,
    stream_weights,
)

from .. import patches
from .hub import HUB_KWARGS, is_hub_id, snapshot_folder

__all__ = [
    "CannotStream",
    "holds_weights",
    "restream",
    "streamed_or_why",
    "streaming_blocker",
    "streamed_from_pretrained",
    "unstream",
]

logger = logging.getLogger(__name__)

_READ_KWARGS = (
    "use_kernels",  # Hub kernels replace layers on the weights' device: a meta model has none
    "device_map",
    "max_memory",
    "offload_folder",
    "offload_buffers",
    "quantization_config",
    "load_in_8bit",
    "load_in_4bit",
    "gguf_file",
    "state_dict",
    "variant",
    "tp_plan",
    "tp_size",
    "distributed_config",
    "ignore_mismatched_sizes",
    "output_loading_info",
    "adapter_name",
    "use_kernels",
    "kernel_config",
    "from_tf",
    "from_flax",
)
"""``from_pretrained`` arguments that change how tensors are read or placed: not streamed."""


class CannotStream(Exception):
    """This checkpoint or these arguments need transformers' full loader (Note: what cannot be streamed)."""


def streaming_blocker(name_or_path: str | os.PathLike[str], kwargs: dict[str, Any]) -> str | None:
    """Why this ``from_pretrained`` call cannot stream, judged before anything is built or downloaded;
    None if it may (a Hub id's snapshot is judged once it is in the cache: ``streamed_or_why``)."""
    passed = [k for k in _READ_KWARGS if kwargs.get(k) is not None and kwargs.get(k) is not False]
    if passed:
        return f"from_pretrained was given {', '.join(passed)}"
    if "_adapter_model_path" in (kwargs.get("adapter_kwargs") or {}):  # the Auto classes found a PEFT adapter
        return f"{name_or_path} holds a PEFT adapter"
    if kwargs.get("use_safetensors") is False:
        return "from_pretrained was given use_safetensors=False"
    return None if is_hub_id(name_or_path) else _folder_blocker(Path(name_or_path, kwargs.get("subfolder") or ""))


def _folder_blocker(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder} is not a local folder or a Hub id"
    if (folder / "adapter_config.json").is_file():
        return f"{folder} holds a PEFT adapter"
    if not (folder / SINGLE_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        return f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE} (a .bin checkpoint?)"
    return None


def streamed_or_why(
    model_class: Any, name_or_path: str | os.PathLike[str], kwargs: dict[str, Any]
) -> tuple[PreTrainedModel | None, str]:
    """``(the streamed model, "")``, or ``(None, why it cannot be streamed)``; a bad checkpoint raises.
    A Hub id is streamed from its snapshot in the cache (``hub.snapshot_folder``: downloaded once per
    host, every rank calls this), the model's ``name_or_path`` staying the id."""
    why, hub_id = streaming_blocker(name_or_path, kwargs), None
    if why is None and is_hub_id(name_or_path):
        hub_id, name_or_path = str(name_or_path), snapshot_folder(str(name_or_path), kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in HUB_KWARGS}
        why = _folder_blocker(Path(name_or_path, kwargs.get("subfolder") or ""))
    if why is not None:
        return None, why
    try:
        model = streamed_from_pretrained(model_class, name_or_path, **kwargs)
    except CannotStream as e:
        return None, str(e)
    if hub_id is not None:
        model.config.name_or_path = hub_id  # what transformers records (PEFT's base_model_name_or_path), not the cache
    return model, ""


def streamed_from_pretrained(model_class: Any, name_or_path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(name_or_path, **kwargs)`` with every parameter left on meta
    and marked as read from the folder's files. Raises ``WeightsError`` for a bad checkpoint
    (a file missing or truncated, a shape or key wrong) and ``CannotStream`` where the full
    loader is needed; call ``streaming_blocker`` first."""
    folder = Path(name_or_path, kwargs.get("subfolder") or "")
    files = CheckpointFiles.open(folder)  # a missing or truncated file is named here, before anything is built
    keys: dict[str, str] = {}
    record = functools.partial(_record, keys)
    with patches.weights_recorded_not_read(record):
        # transformers >= 5.25 kernelizes by default wherever the `kernels` package is installed, which
        # refuses a model on meta; one asked for explicitly is not streamed (streaming_blocker)
        model: PreTrainedModel = model_class.from_pretrained(name_or_path, **{"use_kernels": False, **kwargs})
    initialised = [name for name, p in model.named_parameters() if not p.is_meta]
    if initialised:
        raise WeightsError(
            f"{len(initialised)} parameters of {type(model).__name__} have no tensor in {folder} (e.g. "
            f"{initialised[:3]}): the checkpoint is incomplete or for another model; save it again, or load it "
            "without streaming (elixir_hf.from_pretrained(..., stream=False)) to have transformers initialise them "
            "at random"
        )
    stream_weights(model, files, keys)
    patches.before_inject_adapter(_unstream_for_adapters)
    return model


def holds_weights(rank0_only: bool = True) -> bool:
    """Whether this process loads the weights: every process if not ``rank0_only``, else rank 0.

    The rank comes from the process group if it exists yet, else from the launcher's ``RANK``
    (torchrun and ``accelerate launch`` set it before the script runs).
    """
    if not rank0_only:
        return True
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == 0


def unstream(model: nn.Module) -> None:
    """Today's path for a streamed model: rank 0 reads its whole weights into the parameters (in
    place: the same objects), the others keep them on meta and get rank 0's values in ``prepare``."""
    source = attached_weights(model)
    if holds_weights():
        assert source is not None, "unstream is for a model that carries its weights' source"
        with torch.no_grad():
            for p in source.params:
                value = source.read(p, 0, p.numel(), torch.device("cpu")).view(p.shape)
                torch.utils.swap_tensors(p, torch.nn.Parameter(value, requires_grad=p.requires_grad))
    detach_weights(model)


def _unstream_for_adapters(model: nn.Module) -> None:
    """[Note: PEFT on a streamed model] PEFT puts a new adapter on the device of the layer it adapts
    (``BaseTuner._replace_module``, ``BaseTunerLayer._move_adapter_to_device_of_base_layer``), which
    for a streamed model is ``meta``: the adapter's initial values would be lost. So before PEFT
    injects adapters into a streamed model (``BaseTuner.inject_adapter``, which ``get_peft_model``
    and TRL's ``peft_config`` reach: ``patches.before_inject_adapter``), the model goes back to
    today's path (``unstream``), loudly."""
    source = attached_weights(model)
    if source is not None:
        logger.warning(
            "elixir: a PEFT adapter is added to a model whose weights were to be streamed from %s: rank 0 reads "
            "them now and sends each rank its shards (adapters need the base layers' device)",
            source.origin,
        )
        unstream(model)


def restream(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """A streamed model's weights to come from ``folder`` (a Trainer checkpoint) instead: keys are
    parameter names, as the stock Trainer's resume loads them. Checked before the old source is dropped."""
    files = CheckpointFiles.open(folder)
    detach_weights(model)
    stream_weights(model, files)


def _record(
    keys: dict[str, str],
    model: Any,
    state_dict: dict[str, Any],
    load_config: LoadStateDictConfig,
    disk_offload_index: dict[str, object] | None = None,
) -> tuple[LoadStateDictInfo, dict[str, object] | None]:
    """Stands in for transformers' ``convert_and_load_state_dict_in_model``: the same renaming of
    each checkpoint key, then ``keys[parameter name] = checkpoint key`` instead of a read. Buffers
    the checkpoint holds (small) are loaded."""
    if load_config.hf_quantizer is not None:
        raise CannotStream("the model is quantised")
    if load_config.dtype_plan:
        raise CannotStream(f"{type(model).__name__} keeps modules in float32 under {load_config.dtype}")
    mapping = load_config.weight_mapping or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    prefix = model.base_model_prefix
    expected = model.state_dict()
    buffers = dict(model.named_buffers())
    unexpected: set[str] = set()
    loaded_buffers: set[str] = set()
    for original in sorted(state_dict):
        name, pattern = rename_source_key(original, renamings, converters, prefix, expected)
        if name not in expected and original in expected:  # as transformers: maybe only the prefix differs
            name, pattern = rename_source_key(original, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if name not in expected:
            unexpected.add(name)
            continue
        if pattern is not None:
            raise CannotStream(f"transformers converts {original!r} into {name!r} ({pattern})")
        if name in buffers:
            _load_buffer(model, name, state_dict[original], buffers[name])
            loaded_buffers.add(name)
            continue
        keys[name] = original
        patches.mark_initialized(model.get_parameter(name))  # its initialisation skips it
    patches.keep_weight_conversions(model, [t for t in mapping if t.was_used()])  # what save_pretrained reverts
    info = LoadStateDictInfo(
        missing_keys={k for k in expected if k not in keys and k not in loaded_buffers},
        unexpected_keys=unexpected,
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    return info, disk_offload_index


def _load_buffer(model: Any, name: str, stored: Any, like: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    value = stored[...] if hasattr(stored, "get_shape") else stored
    buffer = value.to(dtype=like.dtype, device="cpu")
    module.register_buffer(attr, buffer)  # persistent: only those are in the state dict it is loaded from
    patches.mark_initialized(buffer)
