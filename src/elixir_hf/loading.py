"""Load (or initialise) a model for the engine without a full copy of it per rank in host memory.

With ``torchrun --nproc_per_node 4`` a plain ``from_pretrained`` puts four full copies of the
model in host memory before Elixir shards it: 4 × 80 GB for a 20B model in fp32, more than most
hosts have. ``from_pretrained`` of a local safetensors folder builds the model on ``meta`` on
every rank and leaves the weights in their files (``stream.py``): ``prepare`` (through the
Trainer's ``--elixir`` or ``ElixirAccelerator``) reads each rank's shards from them, so the host
never holds the model, even on one rank. Where that cannot apply (a hub name, a ``.bin``
checkpoint, quantisation, ...: ``stream.streaming_blocker``), or with ``stream=False``, rank 0
reads the weights and every other rank builds the same module on ``meta``; ``prepare`` fills each
rank's shards from rank 0's tensors. ``from_config`` does the latter. Use them only for a model
Elixir will prepare: DDP or the stock Trainer would train the empty meta copies.

    model = elixir_hf.from_pretrained(AutoModelForCausalLM, "path/to/llama", dtype=torch.bfloat16)
    model = elixir_hf.from_config(AutoModelForCausalLM, config)

A model on meta has no values: train or evaluate it only through Elixir.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from .stream import holds_weights, streamed_or_why

__all__ = ["from_pretrained", "from_config", "holds_weights", "stream_from_pretrained_calls"]

logger = logging.getLogger(__name__)

_CONFIG_KWARGS = ("cache_dir", "revision", "token", "trust_remote_code", "local_files_only", "subfolder")
"""``from_pretrained`` arguments that also locate the config the meta ranks build from."""
_BUILD_KWARGS = ("dtype", "attn_implementation", "trust_remote_code")
"""``from_pretrained`` arguments that shape the built model itself."""


def from_pretrained(
    model_class: Any,
    name_or_path: str | os.PathLike,
    *,
    rank0_only: bool = True,
    stream: bool = True,
    **kwargs: Any,
) -> PreTrainedModel:
    """``model_class.from_pretrained(name_or_path, **kwargs)`` for the engine: the weights streamed
    from their files into each rank's shards, else read on rank 0 and the same model on meta elsewhere.

    ``stream=False``: rank 0 reads them. ``rank0_only=False``: every rank loads them itself (for a
    script whose Elixir is switched off). Without streaming, pass ``dtype`` explicitly (e.g.
    ``torch.float32`` for fp32 master weights): with ``"auto"`` the meta ranks can only read the
    config's ``dtype``, and ``prepare`` refuses ranks whose dtypes differ. A bad checkpoint (a file
    missing or truncated, shapes that do not match the config, a missing weight) raises
    ``elixir_runtime.WeightsError`` naming the file and the fix.
    """
    if stream and rank0_only:
        model, why = streamed_or_why(model_class, name_or_path, kwargs)
        if model is not None:
            return model
        logger.warning(
            "elixir: the weights of %s are not streamed into the chunks: %s; rank 0 reads them and sends each rank "
            "its shards",
            name_or_path,
            why,
        )
    if holds_weights(rank0_only):
        return model_class.from_pretrained(name_or_path, **kwargs)
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        located = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(config or name_or_path, **located)
    return from_config(model_class, config, **{k: kwargs[k] for k in _BUILD_KWARGS if k in kwargs})


def from_config(
    model_class: Any, config: PretrainedConfig, *, rank0_only: bool = True, **kwargs: Any
) -> PreTrainedModel:
    """A new model from ``config``: initialised on rank 0, on meta elsewhere (its values come from rank 0)."""
    if kwargs.get("dtype") == "auto":
        kwargs["dtype"] = getattr(config, "dtype", None) or torch.float32
    build = getattr(model_class, "from_config", None) or model_class._from_config
    if holds_weights(rank0_only):
        return build(config, **kwargs)
    with torch.device("meta"):
        return build(config, **kwargs)


STREAM_ENV = "ELIXIR_STREAM"
"""``0``: ``elixir-run`` leaves the script's ``from_pretrained`` calls as they are."""

_inside = threading.local()


def stream_from_pretrained_calls() -> None:
    """From now on, ``PreTrainedModel.from_pretrained`` (which the Auto classes call) streams the
    weights where it can, as ``from_pretrained`` does; elsewhere it loads as it always did, with a
    warning saying why. ``elixir-run`` installs it when Elixir is on and ``ELIXIR_STREAM`` is not ``0``.

    A model loaded this way runs only once the engine is built on it: a script that loads a
    second model it runs without Elixir (a reference or teacher model) needs ``ELIXIR_STREAM=0``.
    """
    stock = PreTrainedModel.from_pretrained.__func__
    if getattr(stock, "_elixir", False):
        return

    @functools.wraps(stock)
    def from_pretrained(cls: Any, name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or name_or_path is None or getattr(_inside, "active", False):
            return stock(cls, name_or_path, *args, **kwargs)
        _inside.active = True
        try:
            model, why = streamed_or_why(cls, name_or_path, kwargs)
        finally:
            _inside.active = False
        if model is not None:
            return model
        logger.warning("elixir: the weights of %s are not streamed into the chunks: %s", name_or_path, why)
        return stock(cls, name_or_path, **kwargs)

    from_pretrained._elixir = True  # type: ignore[attr-defined]
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign]
