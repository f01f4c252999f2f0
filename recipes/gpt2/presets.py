"""GPT-2 model sizes of the recipe: the GPT-2 shapes of ``elixir_hf.presets`` (OpenAI's four and the
Elixir paper's, appendix B.2 "Model Configurations"), with what the recipe adds to train them.

Built from a config, never downloaded: the recipe trains from scratch unless
``--model_name_or_path`` points at weights. ``tiny`` is the CPU default (trains in about a minute
on two cores); the paper's sizes are what Elixir is for.
"""

from __future__ import annotations

from dataclasses import dataclass

from elixir_hf.presets import PRESETS as MODEL_PRESETS

__all__ = ["Preset", "PRESETS", "GPT2_VOCAB"]

GPT2_VOCAB = 50257
"""The real GPT-2 vocabulary size: named sizes keep it, so parameter counts match the paper's."""


@dataclass(frozen=True)
class Preset:
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB
    tokenizer_vocab: int = 8192
    """Size of the BPE the recipe trains when no tokenizer is given."""


_RECIPE_TINY = {"n_positions": 256, "block_size": 128, "vocab_size": 0, "tokenizer_vocab": 2048}
"""``vocab_size=0``: exactly the tokenizer's size (the smallest embedding)."""

PRESETS: dict[str, Preset] = {
    name: Preset(**shape, **(_RECIPE_TINY if name == "tiny" else {}))
    for name, (family, shape) in MODEL_PRESETS.items()
    if family == "gpt2"
}
