"""Load (or initialise) a model for the engine without a full copy of it per rank in host memory.

With ``torchrun --nproc_per_node 4`` a plain ``from_pretrained`` puts four full copies of the
model in host memory before Elixir shards it: 4 × 80 GB for a 20B model in fp32, more than most
hosts have. ``from_pretrained`` of a safetensors folder (local, or a Hub id's snapshot in the cache,
downloaded once per host: ``hub.py``) builds the model on ``meta`` on every rank and leaves the
weights in their files (``stream.py``): ``prepare`` (through the Trainer's ``--elixir`` or
``ElixirAccelerator``) reads each rank's shards from them, so the host never holds the model, even
on one rank. Where that cannot apply (a ``.bin`` checkpoint, quantisation, ...:
``stream.streaming_blocker``), or with ``stream=False``, rank 0
reads the weights and every other rank builds the same module on ``meta``; ``prepare`` fills each
rank's shards from rank 0's tensors. ``from_config`` builds the model on ``meta`` on every rank
carrying its init, which ``prepare`` draws on each rank's shards on the GPU (``init="rank0"``:
rank 0 initialises it, as ``from_pretrained`` without streaming). Use them only for a model
Elixir will prepare: DDP or the stock Trainer would train the empty meta copies.

    model = elixir_hf.from_pretrained(AutoModelForCausalLM, "meta-llama/Meta-Llama-3-8B", dtype=torch.bfloat16)
    model = elixir_hf.from_config(AutoModelForCausalLM, config)

A model on meta has no values: train or evaluate it only through Elixir.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from elixir_runtime import init_weights

from .. import patches
from ..console import connect_logging
from .stream import holds_weights, streamed_or_why

__all__ = ["from_pretrained", "from_config", "init_in_place", "holds_weights", "stream_from_pretrained_calls"]

logger = logging.getLogger(__name__)

_CONFIG_KWARGS = ("cache_dir", "revision", "token", "trust_remote_code", "local_files_only", "subfolder")
"""``from_pretrained`` arguments that also locate the config the meta ranks build from."""
_BUILD_KWARGS = ("dtype", "attn_implementation", "trust_remote_code")
"""``from_pretrained`` arguments that shape the built model itself."""


def from_pretrained(
    model_class: Any,
    name_or_path: str | os.PathLike[str],
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
    connect_logging()
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
        loaded: PreTrainedModel = model_class.from_pretrained(name_or_path, **kwargs)
        return loaded
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        located = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(config or name_or_path, **located)
    return from_config(model_class, config, init="rank0", **{k: kwargs[k] for k in _BUILD_KWARGS if k in kwargs})


INIT_CHOICES = ("shards", "rank0")


def from_config(
    model_class: Any,
    config: PretrainedConfig,
    *,
    init: str = "shards",
    seed: int | None = None,
    rank0_only: bool = True,
    **kwargs: Any,
) -> PreTrainedModel:
    """A new model from ``config``, its weights drawn by ``prepare`` where the engine keeps them.

    ``init="shards"``: the parameters stay on meta on every rank (buffers real) and the model
    carries its own init (``init_in_place``): each rank draws only its shards, on the GPU, with
    the init's distribution per parameter (not bitwise transformers' draws); ``seed`` (default:
    from torch's global generator, i.e. ``set_seed``) gives the same weights at any rank count.
    ``init="rank0"``: rank 0 initialises the whole model in host memory, the others build it on
    meta and get rank 0's values (for an init that cannot be replayed a range at a time).
    ``rank0_only=False``: every rank initialises the whole model (a script whose Elixir is off).
    """
    if init not in INIT_CHOICES:
        raise ValueError(f"from_config(init={init!r}): choose one of {INIT_CHOICES}")
    connect_logging()
    if kwargs.get("dtype") == "auto":
        kwargs["dtype"] = getattr(config, "dtype", None) or torch.float32
    build: Callable[..., PreTrainedModel] = getattr(model_class, "from_config", None) or model_class._from_config
    if not rank0_only or (init == "rank0" and holds_weights()):
        return build(config, **kwargs)
    if init == "rank0":
        with torch.device("meta"):
            return build(config, **kwargs)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build(config, **kwargs)
    init_in_place(model, seed)
    return model


def init_in_place(model: PreTrainedModel, seed: int | None = None) -> None:
    """A model whose parameters are on meta (buffers real: ``accelerate.init_empty_weights()``)
    carries transformers' init of it (``_init_weights`` through ``initialize_weights``), which
    ``prepare`` draws on each rank's shards (``elixir_runtime.init_weights``; raises
    ``elixir_runtime.InitError`` naming the parameter whose init cannot be drawn a range at a time)."""

    model.tie_weights()  # accelerate's init_empty_weights makes a new meta parameter of a tied one

    def initialize() -> None:
        for m in model.modules():  # run at build on meta (no values): marked done, so run again
            m.__dict__.pop("_is_hf_initialized", None)
        model.initialize_weights()

    init_weights(model, initialize, seed)


STREAM_ENV = "ELIXIR_STREAM"
"""``0``: ``elixir-run`` leaves the script's ``from_pretrained`` calls as they are."""

_inside = threading.local()


def stream_from_pretrained_calls() -> None:
    """From now on, ``from_pretrained`` of every model class and Auto class streams the weights
    where it can, as ``from_pretrained`` does (a Hub id from its snapshot in the cache, downloaded
    once per host); elsewhere it loads as it always did, with a warning saying why. ``elixir-run``
    installs it when Elixir is on and ``ELIXIR_STREAM`` is not ``0``.

    A model loaded this way runs only once the engine is built on it: a script that loads a
    second model it runs without Elixir (a reference or teacher model) needs ``ELIXIR_STREAM=0``.
    """
    patches.from_pretrained_through(_streamed_else_stock)


def _streamed_else_stock(
    stock: Callable[..., PreTrainedModel], cls: type, name_or_path: str | os.PathLike[str], kwargs: dict[str, object]
) -> PreTrainedModel:
    if getattr(_inside, "active", False):  # decided already: an Auto class's model class, the streamed load
        return stock(name_or_path, **kwargs)
    _inside.active = True
    try:
        model, why = streamed_or_why(cls, name_or_path, kwargs)
        if model is None:
            logger.warning("elixir: the weights of %s are not streamed into the chunks: %s", name_or_path, why)
            model = stock(name_or_path, **kwargs)
    finally:
        _inside.active = False
    return model
