"""Load (or initialise) a model on rank 0 only; the other ranks build it on the ``meta`` device.

With ``torchrun --nproc_per_node 4`` a plain ``from_pretrained`` puts four full copies of the
model in host memory before Elixir shards it: 4 × 80 GB for a 20B model in fp32, more than most
hosts have. With these two functions the host holds one copy: rank 0 reads the weights, every
other rank gets the same module on ``meta`` (no memory), and ``prepare`` (through the Trainer's
``--elixir`` or ``ElixirAccelerator``) fills each rank's shards from rank 0's tensors. In a single
process they are plain ``from_pretrained`` / ``from_config``. Use them only for a model Elixir
will prepare: DDP or the stock Trainer would train the empty meta copies.

    model = elixir_hf.from_pretrained(AutoModelForCausalLM, "gpt2-xl", dtype=torch.float32)
    model = elixir_hf.from_config(AutoModelForCausalLM, config)

The model on ranks other than 0 has no values: train or evaluate it only through Elixir.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

__all__ = ["from_pretrained", "from_config", "holds_weights"]

_CONFIG_KWARGS = ("cache_dir", "revision", "token", "trust_remote_code", "local_files_only", "subfolder")
"""``from_pretrained`` arguments that also locate the config the meta ranks build from."""
_BUILD_KWARGS = ("dtype", "attn_implementation", "trust_remote_code")
"""``from_pretrained`` arguments that shape the built model itself."""


def holds_weights(rank0_only: bool = True) -> bool:
    """Whether this process loads the weights: every process if not ``rank0_only``, else rank 0.

    The rank comes from the process group if it exists yet, else from the launcher's ``RANK``
    (torchrun and ``accelerate launch`` set it before the script runs).
    """
    if not rank0_only:
        return True
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank == 0


def from_pretrained(
    model_class: Any, name_or_path: str | os.PathLike, *, rank0_only: bool = True, **kwargs: Any
) -> PreTrainedModel:
    """``model_class.from_pretrained(name_or_path, **kwargs)`` on rank 0; the same model on meta elsewhere.

    ``rank0_only=False`` loads on every rank (for a script whose Elixir is switched off). Pass
    ``dtype`` explicitly (e.g. ``torch.float32`` for fp32 master weights): with ``"auto"`` the meta
    ranks can only read the config's ``dtype``, and ``prepare`` refuses ranks whose dtypes differ.
    """
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
