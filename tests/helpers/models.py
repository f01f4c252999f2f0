"""Tiny, offline, seed-deterministic models for runtime tests.

Every builder constructs from a config (never from the Hub), seeds the RNG in
a forked scope so the caller's global RNG state is untouched, and disables
dropout so two builds with the same seed give bit-identical losses.  Eager
attention is used because it is deterministic on CPU across torch versions.

Devices (``helpers.device``): a model is built on the CPU, where a user's is when it reaches
``prepare``; one the test runs as plain PyTorch, to compare the engine against, is moved to
``device=local_device()`` (the same weights). Batches are made on ``local_device()``, where the
engine of the test computes.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from .device import local_device

ATTN_IMPL = "eager"

# Special token ids kept well inside any tiny vocab (vocab >= 4).
BOS_ID = 1
EOS_ID = 2
PAD_ID = 0


def preset_on_meta(name: str, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """An ``elixir-plan`` preset (``elixir_hf.presets``) at full size on ``meta``, checkpointing on."""
    from elixir_hf.presets import PRESETS

    family, fields = PRESETS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _build(config: PretrainedConfig, seed: int, device: torch.device | None) -> PreTrainedModel:
    """Instantiate a causal LM from ``config`` under a private, seeded RNG, on the CPU (or the device
    context's: ``meta``), then moved to ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPL)
    model.train()
    return model if device is None else model.to(device)


def tiny_gpt2(
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 4,
    vocab: int = 128,
    n_positions: int = 64,
    tie: bool = True,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """GPT-2 with learned positions and (by default) tied input/output embeddings."""
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return _build(config, seed, device)


def tiny_opt(
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 4,
    vocab: int = 128,
    n_positions: int = 64,
    tie: bool = True,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """OPT (pre-LN, ReLU FFN, offset learned positions); tied by default like the real one."""
    config = OPTConfig(
        vocab_size=vocab,
        hidden_size=n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        ffn_dim=4 * n_embd,
        max_position_embeddings=n_positions,
        word_embed_proj_dim=n_embd,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return _build(config, seed, device)


def tiny_llama(
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 4,
    vocab: int = 128,
    n_positions: int = 64,
    tie: bool = False,
    n_kv_head: int | None = None,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """Llama (RMSNorm, RoPE, SwiGLU, optional GQA); untied by default like the real one."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=n_embd,
        intermediate_size=2 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head if n_kv_head is not None else n_head,
        max_position_embeddings=n_positions,
        attention_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return _build(config, seed, device)


MODEL_BUILDERS: dict[str, Callable[..., PreTrainedModel]] = {
    "gpt2": tiny_gpt2,
    "opt": tiny_opt,
    "llama": tiny_llama,
}


def make_batch(
    vocab: int, batch: int = 2, seq: int = 16, seed: int = 0, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Random token batch on ``device`` (default: ``local_device()``), the same tokens on any;
    ``labels`` equals ``input_ids`` because HF shifts internally."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen, dtype=torch.long)
    input_ids = input_ids.to(local_device() if device is None else device)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


@dataclass
class MLPOutput:
    """Mimics the ``.loss`` / ``.logits`` surface of an HF ModelOutput."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyMLP(nn.Module):
    """Plain classifier MLP for exercising edge cases HF models don't cover.

    ``unused_branch`` adds a parameterised module that forward never calls
    (its grads stay ``None``); ``freeze_first`` sets ``requires_grad=False``
    on the first layer (frozen params mixed with trainable ones).
    """

    def __init__(
        self,
        d_in: int = 8,
        d_hidden: int = 16,
        n_classes: int = 4,
        n_layers: int = 2,
        unused_branch: bool = False,
        freeze_first: bool = False,
    ) -> None:
        super().__init__()
        in_dims = [d_in] + [d_hidden] * (n_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(d, d_hidden) for d in in_dims)
        self.head = nn.Linear(d_hidden, n_classes)
        self.unused: nn.Linear | None = nn.Linear(d_hidden, d_hidden) if unused_branch else None
        if freeze_first:
            self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> MLPOutput:
        h = x
        for layer in self.layers:
            h = torch.relu(layer(h))
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return MLPOutput(loss=loss, logits=logits)


def tiny_mlp(seed: int = 0, **kwargs: Any) -> TinyMLP:
    """Seeded :class:`TinyMLP`; ``kwargs`` go to its constructor."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyMLP(**kwargs)


def make_mlp_batch(d_in: int = 8, n_classes: int = 4, batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs and class labels matching :class:`TinyMLP` defaults, on ``local_device()``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=gen)
    labels = torch.randint(0, n_classes, (batch,), generator=gen)
    return {"x": x.to(local_device()), "labels": labels.to(local_device())}


def read_head_outside(model: PreTrainedModel) -> nn.Parameter:
    """Gives ``model`` (an HF causal LM taking ``input_ids`` and ``labels``) the forward Liger's fused
    linear cross entropy and TRL's fused LM head have: the backbone, then the head's weight read
    without calling the head, and a loss averaged over the counted labels (``item()``). Returns the
    weight so read."""
    head = model.get_output_embeddings()

    def forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> torch.Tensor:
        hidden = self.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
        logits = hidden @ head.weight.t()
        target = labels[:, 1:].flatten()
        count = (target != -100).sum().item()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target, reduction="sum") / count

    model.forward = types.MethodType(forward, model)
    return head.weight
