"""Shared set-up for the HF integration tests: one tiny causal-LM task, run by the stock
``Trainer`` or by ``ElixirTrainer`` with identical arguments, and what to compare."""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments, default_data_collator

from elixir_hf import ElixirTrainer, ElixirTrainingArguments
from helpers.models import BOS_ID, EOS_ID, MODEL_BUILDERS, PAD_ID

VOCAB = 128
SEQ = 16
# A plan that exercises the engine: half the chunks offloaded, the smallest rCache.
OFFLOAD_PLAN = '{"mode": "static", "n_blocks": "min", "offload": 0.5}'


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; labels are the inputs (HF shifts them)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(output_dir: str, elixir: str | None = None, **overrides: Any) -> TrainingArguments:
    """Adam eps=1e-6: with 1e-8, Adam turns round-off-only gradients (GPT-2's attention key bias)
    into lr-sized steps, and two correct implementations drift apart in those weights."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=20,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        adam_epsilon=1e-6,
        weight_decay=0.1,
        max_grad_norm=0.5,  # below the typical norm (~1): clipping is active
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    if elixir is None:
        return TrainingArguments(**kwargs)
    return ElixirTrainingArguments(elixir=elixir, **kwargs)


def make_trainer(
    model: str | torch.nn.Module, args: TrainingArguments, n_train: int = 200, **model_kwargs: Any
) -> Trainer:
    """``ElixirTrainer`` when the args enable Elixir, else the stock ``Trainer``; ``model``: a
    builder's name (seed 0) or a built model."""
    cls = ElixirTrainer if getattr(args, "elixir_plugin", None) is not None else Trainer
    return cls(
        model=model
        if isinstance(model, torch.nn.Module)
        else MODEL_BUILDERS[model](seed=0, vocab=VOCAB, **model_kwargs),
        args=args,
        train_dataset=TokenDataset(n_train),
        eval_dataset=TokenDataset(16, seed=1),
        data_collator=default_data_collator,
    )


def history(trainer: Trainer, key: str, after_step: int = 0) -> list[float]:
    """One value per logged step (``loss``, ``grad_norm``, ``learning_rate``, ``eval_loss``)."""
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > after_step]


def save_tiny_lm(path: Path, arch: str = "gpt2") -> Path:
    """A tiny ``arch`` model (``MODEL_BUILDERS``: GPT-2's head is tied, Llama's is not; seed 0) and a
    word-level tokenizer over its vocabulary (two-letter words), as a ``from_pretrained`` folder:
    what a script's ``--model_name_or_path`` loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    MODEL_BUILDERS[arch](seed=0, vocab=VOCAB).save_pretrained(path)
    specials = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>", 3: "<unk>"}
    words = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)][: VOCAB - len(specials)]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials.values(), *words])}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return path
