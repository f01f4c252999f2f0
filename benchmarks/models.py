"""GPT-2 presets of the throughput table, built fast: on ``meta``, then materialized and filled.

HF's own init of a 6.5B model on the CPU takes minutes; filling the weights with values drawn on
the GPU in pieces takes seconds, so one configuration of the table runs in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from elixir_hf.presets import ALIASES
from elixir_hf.presets import PRESETS as MODEL_PRESETS

SEQ = 1024
VOCAB = 50257
INIT_STD = 0.02
_PIECE = 1 << 26
"""Elements drawn per piece when filling: bounds the temporary on the drawing device (256 MiB fp32)."""


@dataclass(frozen=True)
class Preset:
    name: str
    n_embd: int
    n_layer: int
    n_head: int


_SIZES = ("tiny", "gpt2-1.5b", "gpt2-4b", "gpt2-6.5b", "gpt2-10b", "gpt2-15b", "gpt2-20b")
PRESETS: dict[str, Preset] = {n: Preset(n, **MODEL_PRESETS[n][1]) for n in _SIZES}
"""The sizes of the throughput table (``elixir_hf.presets``); ``tiny`` for CPU smoke runs only."""
PRESETS.update({alias: PRESETS[name] for alias, name in ALIASES.items() if name in PRESETS})


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(_SIZES)}") from None


def gpt2_config(p: Preset, seq: int = SEQ):
    """HF GPT-2 config of the table: SDPA, no dropout, tied embeddings, no KV cache."""
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=p.n_embd,
        n_layer=p.n_layer,
        n_head=p.n_head,
        n_positions=seq,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing on every block (the API was renamed in transformers 5.2x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def build_meta(p: Preset, seq: int = SEQ, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model on ``meta`` (no memory, no init), checkpointing on, in ``dtype``."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(p, seq)).to(dtype)
    enable_checkpointing(model)
    return model


def count_params(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding once): the P of the paper's 8·P·tokens."""
    return sum(p.numel() for p in model.parameters())


def param_count(p: Preset) -> int:
    return count_params(build_meta(p))


def materialize(model: nn.Module, device: torch.device | str, fill_device: torch.device | str, seed: int = 0) -> nn.Module:
    """Allocates a ``meta`` model's storage on ``device`` and fills it with GPT-2 init.

    ``to_empty`` unties the embeddings of a plain module, so they are tied again here.
    """
    model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight
    fill_gpt2_init_(model.named_parameters(), fill_device, seed)
    return model


@torch.no_grad()
def fill_gpt2_init_(named: Iterable[tuple[str, torch.Tensor]], fill_device: torch.device | str, seed: int = 0) -> None:
    """GPT-2 init (weights N(0, 0.02), LayerNorm weights 1, biases 0) of tensors anywhere.

    Accepts local tensors of DTensors / DeepSpeed partitions: callers pass what each rank owns.
    Random values are drawn on ``fill_device`` in pieces and copied, which is fast for CPU targets.
    """
    from torch.distributed.tensor import DTensor

    gen = torch.Generator(device=fill_device)
    gen.manual_seed(seed)
    for name, t in named:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.numel() == 0:
            continue
        if name.endswith("bias"):
            t.zero_()
        elif ".ln_" in name or "ln_f" in name:
            t.fill_(1.0)
        else:
            flat = t.view(-1)
            for start in range(0, flat.numel(), _PIECE):
                n = min(_PIECE, flat.numel() - start)
                piece = torch.empty(n, device=fill_device).normal_(0.0, INIT_STD, generator=gen)
                flat[start : start + n].copy_(piece)
