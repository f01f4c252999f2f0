"""Model presets, one table for ``elixir-plan --model``, the GPT-2 recipe and the benchmarks.

One name per size: OpenAI's GPT-2 sizes under their Hub names up to ``gpt2-large``, then
``gpt2-<size>`` as the Elixir paper names its models (appendix B.2, "Model Configurations":
``gpt2-4b`` ... ``gpt2-20b``), with ``gpt2-1.5b`` (OpenAI's largest) and ``gpt2-6.5b`` (just
overflows one 80 GB card: 16 B/param of states) in the same style. ``tiny`` is the CPU model of the
recipe and of the benchmarks' smoke runs. Only the shape
lives here; each user adds its own context (sequence length, vocabulary, dropout). The other
families carry their whole published config (vocabulary and rope included), since it is the shape:
``llama3-8b`` (Meta-Llama-3-8B's config.json, 8.03 B parameters) and ``qwen2.5-7b`` (Qwen2.5-7B's,
7.62 B; its q/k/v biases are built into HF's Qwen2 model), the models users fine-tune most, and the
larger shapes the planning table sizes boxes by: ``llama2-13b`` (13.0 B), ``codellama-34b`` (33.7 B)
and ``llama2-70b`` (69.0 B). The SFT recipes' models (``recipes/sft``) too: ``llama3.1-8b``
(Llama-3.1-8B's config.json: Llama-3-8B's shape, rope scaled to 128K positions), ``qwen2.5-14b``
(Qwen2.5-14B's, 14.8 B) and ``mistral-7b-v0.3`` (Mistral-7B-v0.3's, 7.25 B: a 32768 vocabulary,
no sliding window). The 24–72 B models one node fine-tunes, from their config.json: ``mistral-small-24b``
(Mistral-Small-24B-Base-2501, 23.6 B), ``gemma2-27b`` (gemma-2-27b, 27.2 B: tied embeddings, a 256000
vocabulary), ``qwen2.5-32b`` (32.8 B), ``llama3.1-70b`` (Llama-3.1-70B, 70.6 B) and ``qwen2.5-72b``
(72.7 B).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "ALIASES", "canonical_name", "close_presets"]

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (HF model_type, its config's shape fields)
    "tiny": ("gpt2", {"n_embd": 128, "n_layer": 4, "n_head": 4}),
    "gpt2": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12}),
    "gpt2-medium": ("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt2-large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "gpt2-1.5b": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
    "gpt2-4b": ("gpt2", {"n_embd": 3072, "n_layer": 32, "n_head": 24}),
    "gpt2-6.5b": ("gpt2", {"n_embd": 4096, "n_layer": 32, "n_head": 32}),
    "gpt2-10b": ("gpt2", {"n_embd": 4096, "n_layer": 48, "n_head": 32}),
    "gpt2-15b": ("gpt2", {"n_embd": 8192, "n_layer": 18, "n_head": 64}),
    "gpt2-20b": ("gpt2", {"n_embd": 8192, "n_layer": 24, "n_head": 64}),
    "opt-175b": (
        "opt",
        {
            "hidden_size": 12288,
            "num_hidden_layers": 96,
            "num_attention_heads": 96,
            "ffn_dim": 49152,
            "max_position_embeddings": 2048,
            "word_embed_proj_dim": 12288,
            "vocab_size": 50272,
        },
    ),
    "llama2-7b": (
        "llama",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
    ),
    "llama2-13b": (
        "llama",
        {
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 40,
            "intermediate_size": 13824,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "codellama-34b": (
        "llama",
        {
            "hidden_size": 8192,
            "num_hidden_layers": 48,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 22016,
            "vocab_size": 32016,
            "max_position_embeddings": 16384,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "llama2-70b": (
        "llama",
        {
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 28672,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "llama3-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-7b": (
        "qwen2",
        {
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "vocab_size": 152064,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        },
    ),
    "qwen2.5-14b": (
        "qwen2",
        {
            "hidden_size": 5120,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "intermediate_size": 13824,
            "vocab_size": 152064,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        },
    ),
    "mistral-7b-v0.3": (
        "mistral",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 32768,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    ),
}

# Llama-3.1-8B: Llama-3-8B's shape, 128K positions by llama3 rope scaling
PRESETS["llama3.1-8b"] = (
    "llama",
    {
        **PRESETS["llama3-8b"][1],
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
)

PRESETS["llama3.1-70b"] = (
    "llama",
    {
        **PRESETS["llama3.1-8b"][1],
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
    },
)

PRESETS["mistral-small-24b"] = (
    "mistral",
    {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 32768,
        "vocab_size": 131072,
        "max_position_embeddings": 32768,
        "rope_theta": 100000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
)

PRESETS["gemma2-27b"] = (
    "gemma2",
    {
        "hidden_size": 4608,
        "num_hidden_layers": 46,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "intermediate_size": 36864,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 144,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
)

for _name, _shape in {
    "qwen2.5-32b": {"num_hidden_layers": 64, "intermediate_size": 27648},
    "qwen2.5-72b": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "intermediate_size": 29568,
    },
}.items():
    PRESETS[_name] = ("qwen2", {**PRESETS["qwen2.5-14b"][1], **_shape})  # 14B's vocabulary, rope, norms, 8 kv heads

ALIASES: dict[str, str] = {
    "gpt2-xl": "gpt2-1.5b",  # the Hub's name; docs/planning.md's measured table
    "1.5b": "gpt2-1.5b",  # recorded runs (docs/benchmarks/results.json) and the README's commands
    "6.5b": "gpt2-6.5b",
}
"""Older names still accepted, because recorded results and commands in the docs use them."""


def canonical_name(name: str) -> str | None:
    """The preset ``name`` (any case, ``_`` for ``-``, or an alias) stands for; ``None`` if it is none."""
    key = name.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    return key if key in PRESETS else None


def close_presets(name: str) -> list[str]:
    """Presets ``name`` may have meant (a typo's neighbours), closest first."""
    import difflib

    return difflib.get_close_matches(name.lower(), [*PRESETS, *ALIASES], n=3, cutoff=0.6)
