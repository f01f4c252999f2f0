"""Models of the throughput table, built fast: on ``meta``, then materialized and filled.

GPT-2 presets (the Elixir paper's sizes, seq 1024), the other presets of ``elixir_hf.presets``
(``llama3-8b``, ``qwen2.5-7b``: seq 2048, the length users fine-tune them at) and any HF decoder
config (a ``config.json`` or a local model folder), all with random init: the table measures
speed, not quality, and needs no download. HF's own init of a 6.5B model on the CPU takes
minutes; filling the weights with values drawn on the GPU in pieces takes seconds, so one
configuration of the table runs in minutes.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elixir_hf.presets import ALIASES, canonical_name
from elixir_hf.presets import PRESETS as MODEL_PRESETS

SEQ = 1024
"""GPT-2 presets' default sequence length (the paper's)."""
DECODER_SEQ = 2048
"""Every other model's default (capped at its ``max_position_embeddings``)."""
VOCAB = 50257
INIT_STD = 0.02
_PIECE = 1 << 26
"""Elements drawn per piece when filling: bounds the temporary on the drawing device (256 MiB fp32)."""


@dataclass(frozen=True)
class Preset:
    """A GPT-2 size of the table: tied embeddings, vocab 50257, positions = the run's sequence length."""

    name: str
    n_embd: int
    n_layer: int
    n_head: int

    default_seq = SEQ

    def config(self, seq: int = SEQ):
        return gpt2_config(self, seq)


@dataclass(frozen=True)
class DecoderModel:
    """Any HF causal LM from its config (a preset of ``elixir_hf.presets``, a ``config.json`` or a
    model folder), as given: its vocabulary, tying, rope and biases are the model's."""

    name: str
    hf_config: Any = field(compare=False, repr=False)
    """The ``PretrainedConfig``; each build gets a copy."""

    @property
    def default_seq(self) -> int:
        return min(DECODER_SEQ, self.hf_config.max_position_embeddings)

    def config(self, seq: int = DECODER_SEQ):
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and seq > limit:
            raise ValueError(
                f"--seq {seq} exceeds {self.name}'s max_position_embeddings ({limit}); pass --seq <= {limit}"
            )
        config = copy.deepcopy(self.hf_config)
        config.use_cache = False
        config._attn_implementation = "sdpa"
        return config


Model = Preset | DecoderModel

_SIZES = ("tiny", "gpt2-1.5b", "gpt2-4b", "gpt2-6.5b", "gpt2-10b", "gpt2-15b", "gpt2-20b")
PRESETS: dict[str, Preset] = {n: Preset(n, **MODEL_PRESETS[n][1]) for n in _SIZES}
"""The GPT-2 sizes of the throughput table (``elixir_hf.presets``); ``tiny`` for CPU smoke runs only."""
PRESETS.update({alias: PRESETS[name] for alias, name in ALIASES.items() if name in PRESETS})
DECODER_PRESETS = tuple(n for n, (family, _) in MODEL_PRESETS.items() if family != "gpt2")
"""The other presets (``llama3-8b``, ``qwen2.5-7b``, ...), built from their whole config."""


def preset(name: str) -> Model:
    """A GPT-2 size, another preset, or a path to a ``config.json`` / a folder holding one."""
    if name in PRESETS:
        return PRESETS[name]
    key = canonical_name(name)
    if key is not None and key in DECODER_PRESETS:
        from transformers import AutoConfig

        family, fields = MODEL_PRESETS[key]
        return DecoderModel(key, AutoConfig.for_model(family, **fields))
    if Path(name).exists():
        from transformers import AutoConfig

        return DecoderModel(name, AutoConfig.from_pretrained(name))
    raise ValueError(
        f"unknown model {name!r}: pass a preset ({', '.join((*_SIZES, *DECODER_PRESETS))}), "
        "a config.json or a local model folder"
    )


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


def causal_lm(config) -> nn.Module:
    """The HF causal LM of ``config``, built by its class (so ``deepspeed.zero.Init`` sees every module made)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def build_meta(p: Model, seq: int | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model on ``meta`` (no memory, no init), checkpointing on, in ``dtype``."""
    with torch.device("meta"):
        model = causal_lm(p.config(seq or p.default_seq)).to(dtype)
    enable_checkpointing(model)
    return model


def build_initialised_in_place(p: Model, seq: int | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model with its parameters on ``meta`` and real buffers, carrying transformers' init of it
    (``elixir_hf.loading.model.init_in_place``): ``prepare`` draws each rank's shards on the GPU, no rank
    holds the model in host memory. Seed 0, as ``materialize``'s."""
    from accelerate import init_empty_weights

    from elixir_hf.loading.model import init_in_place

    with init_empty_weights(include_buffers=False):
        model = causal_lm(p.config(seq or p.default_seq)).to(dtype)
    init_in_place(model, seed=0)
    enable_checkpointing(model)
    return model


def use_fused_head(model: nn.Module) -> list[nn.Parameter]:
    """Gives ``model`` (an HF causal LM) the forward of TRL's fused LM head
    (``trl.trainer.utils.add_fused_lm_head``): the backbone, then the hidden states times the output
    embedding's weight, read without calling the head module, then the model's loss function.
    Returns the parameters so read: what ``prepare(..., resident=...)`` takes."""
    from transformers.modeling_outputs import CausalLMOutput

    backbone, head = model.base_model, model.get_output_embeddings()

    def forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = backbone(input_ids=input_ids).last_hidden_state @ head.weight.t()
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutput(loss=loss, logits=logits)

    model.forward = types.MethodType(forward, model)
    return [head.weight]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (the classes HF names in ``_no_split_modules``): FSDP2's wrapping units."""
    names = set(model._no_split_modules or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({names}): "
            "FSDP2 needs the layers to shard one by one"
        )
    return found


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding once, an untied lm_head too): the P of the paper's
    8·P·tokens, the one rule of every row (no attention term)."""
    return sum(p.numel() for p in model.parameters())


def param_count(p: Model, seq: int | None = None) -> int:
    return count_params(build_meta(p, seq))


def attention_flops_per_token(p: Model, seq: int) -> int:
    """Causal attention's FLOPs per token of a ``seq``-token sequence, forward and backward (no recompute):
    ``6 x layers x seq x hidden`` (QK^T and AV, 2 FLOPs a multiply-add, half the pairs masked, backward twice
    the forward), what the ``6 x params`` of MFU leaves out."""
    config = p.config(seq)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    return 6 * layers * seq * hidden


def vocab_size(p: Model) -> int:
    return p.hf_config.vocab_size if isinstance(p, DecoderModel) else VOCAB


def materialize(
    model: nn.Module, device: torch.device | str, fill_device: torch.device | str, seed: int = 0
) -> nn.Module:
    """Allocates a ``meta`` model's storage on ``device`` and fills it with GPT-2 init.

    ``to_empty`` unties the embeddings of a plain module, so a tied model's are tied again here.
    """
    model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    restore_buffers_(model)
    fill_init_(model.named_parameters(), fill_device, seed)
    return model


@torch.no_grad()
def restore_buffers_(model: nn.Module, device: torch.device | str | None = None) -> None:
    """Recomputes the buffers ``to_empty`` left uninitialized, e.g. Llama/Qwen's rotary ``inv_freq`` (garbage
    there made DeepSpeed's losses NaN): the model's skeleton is built again with real buffers (parameters
    on ``meta``, no memory) and its buffers put in, on ``device`` (default: where the old ones were; FSDP2
    with CPU offload needs them on the GPU, as torchtitan's ``buffer_device``). GPT-2 has none."""
    from accelerate import init_empty_weights

    if next(model.buffers(), None) is None:
        return
    with init_empty_weights(include_buffers=False):
        fresh = causal_lm(copy.deepcopy(model.config))
    modules = dict(model.named_modules())
    for name, value in fresh.named_buffers():
        owner, _, key = name.rpartition(".")
        old = modules[owner]._buffers[key]
        modules[owner]._buffers[key] = value.to(device or old.device, old.dtype)


def _is_norm_weight(name: str) -> bool:
    """GPT-2's ``ln_1``/``ln_f``, Llama/Qwen's ``*_layernorm``/``norm``, OPT's ``*_layer_norm``."""
    return name.endswith("weight") and (".ln_" in name or "ln_f" in name or "norm" in name)


@torch.no_grad()
def fill_init_(named: Iterable[tuple[str, torch.Tensor]], fill_device: torch.device | str, seed: int = 0) -> None:
    """GPT-2 init (weights N(0, 0.02), norm weights 1, biases 0; Llama's initializer_range is 0.02 too)
    of tensors anywhere.

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
        elif _is_norm_weight(name):
            t.fill_(1.0)
        else:
            flat = t.view(-1)
            for start in range(0, flat.numel(), _PIECE):
                n = min(_PIECE, flat.numel() - start)
                piece = torch.empty(n, device=fill_device).normal_(0.0, INIT_STD, generator=gen)
                flat[start : start + n].copy_(piece)
