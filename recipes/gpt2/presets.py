"""GPT-2 model sizes: OpenAI's four and the Elixir paper's (appendix B.2, "Model Configurations").

Built from a config, never downloaded: the recipe trains from scratch unless
``--model_name_or_path`` points at weights. ``tiny`` is the CPU default (trains in about a minute
on two cores); the paper's sizes are what Elixir is for.
"""

from __future__ import annotations

from dataclasses import dataclass

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


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 4, 4, n_positions=256, block_size=128, vocab_size=0, tokenizer_vocab=2048),
    "small": Preset(768, 12, 12),
    "medium": Preset(1024, 24, 16),
    "large": Preset(1280, 36, 20),
    "xl": Preset(1600, 48, 25),
    "gpt2-4b": Preset(3072, 32, 24),
    "gpt2-10b": Preset(4096, 48, 32),
    "gpt2-15b": Preset(8192, 18, 64),
    "gpt2-20b": Preset(8192, 24, 64),
}
"""``vocab_size=0``: exactly the tokenizer's size (the smallest embedding)."""
