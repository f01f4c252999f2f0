#!/usr/bin/env python
"""Train (or fine-tune) a GPT-2 causal LM with the Elixir engine under the HF Trainer.

Modelled on transformers' ``examples/pytorch/language-modeling/run_clm.py`` (same argument names,
the same ``datasets`` pipeline: ``--streaming``, ``--preprocessing_num_workers``,
``--keep_linebreaks``, cached ``map``), with Elixir on by default (``--elixir auto``; ``--elixir off``
is the stock Trainer). Runs offline out of the box: with no arguments it builds a corpus from the
source of Python's standard library, trains a byte-level BPE on it, and trains a model sized for
the machine (``tiny`` on CPU, ``gpt2`` on a GPU), printing the Elixir plan, a falling loss and the
validation perplexity. ``--model_name_or_path`` trains any causal LM instead (a local folder, or a
hub id when online), with its own tokenizer.

    python recipes/gpt2/train.py                                     # CPU or one GPU
    python recipes/gpt2/train.py --model_size gpt2-4b --bf16         # the paper's 4B model, one GPU
    python recipes/gpt2/train.py --model_name_or_path path/to/llama --train_file corpus.txt
    accelerate launch --config_file recipes/elixir.yaml recipes/gpt2/train.py --model_size gpt2-10b
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

import datasets
import torch
from data import lm_datasets, load_raw, train_tokenizer, training_texts
from presets import PRESETS
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import elixir_hf
from elixir_hf import ElixirTrainer, ElixirTrainingArguments

logger = logging.getLogger("gpt2-recipe")
ON_GPU = torch.cuda.is_available()


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A local checkpoint folder (or a hub id when online) to fine-tune."}
    )
    model_size: str | None = field(
        default=None,
        metadata={"help": f"Train from scratch at one of {list(PRESETS)}. Default: tiny on CPU, gpt2 (124M) on GPU."},
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Override config values, e.g. 'n_embd=256,resid_pdrop=0.0'."}
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer folder or hub id."})
    tokenizer_vocab_size: int | None = field(
        default=None, metadata={"help": "Size of the BPE trained when no tokenizer is given (preset default)."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where from_pretrained caches downloads."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets` dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "A .txt, .json/.jsonl or .csv training file."})
    validation_file: str | None = field(default=None, metadata={"help": "A validation file of the same kind."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Share of the training documents held out when there is no validation set."}
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per training sequence (the preset's; for a loaded model min(1024, its positions))."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the validation blocks."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (needs --max_steps)."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep the line breaks of .txt files."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenizing and grouping."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize and group again, ignoring the cache."})
    corpus_mb: float | None = field(
        default=None if ON_GPU else 2.0,
        metadata={"help": "Megabytes of the default corpus to use (all of it, ~12 MB, on a GPU; 2 on CPU)."},
    )


class RecipeTrainer(ElixirTrainer):
    """Adds ``eval_perplexity = exp(eval_loss)`` to every evaluation log."""

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))
        super().log(logs, *args, **kwargs)


def training_defaults() -> dict:
    """Defaults that make a bare ``train.py`` a short, visible run on whatever machine this is."""
    names = {f.name for f in fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    defaults = dict(
        output_dir="runs/gpt2",
        elixir=os.environ.get("ELIXIR_CONFIG", "auto"),
        do_train=True,
        do_eval=True,
        eval_strategy="steps",
        logging_steps=10,
        log_level="info",  # the Elixir plan, the Trainer's run summary
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        weight_decay=0.1,
        adam_beta2=0.95,
        warmup_steps=0.05,
        save_strategy="steps",
        save_steps=500,
        save_total_limit=2,
        bf16=ON_GPU and torch.cuda.is_bf16_supported(),
        **{checkpointing: True},
    )
    if ON_GPU:  # 200 x 8 x 1024 tokens: about half an epoch of the default corpus (data.py)
        defaults.update(max_steps=200, eval_steps=50, learning_rate=3e-4)
    else:  # about a minute on two cores
        defaults.update(max_steps=200, eval_steps=50, learning_rate=2e-3, dataloader_pin_memory=False)
    return defaults


def parse_args() -> tuple[ModelArguments, DataArguments, ElixirTrainingArguments]:
    parser = HfArgumentParser((ModelArguments, DataArguments, ElixirTrainingArguments))
    parser.set_defaults(**training_defaults())
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        with open(sys.argv[1]) as f:
            return parser.parse_dict({**training_defaults(), **json.load(f)})
    return parser.parse_args_into_dataclasses()


def build_tokenizer(model_args: ModelArguments, preset, texts: Callable[[], Iterable[str]], block_size: int | None):
    """The model's (or ``--tokenizer_name``'s) tokenizer, else a BPE trained on ``texts()`` for the preset."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is not None:
        return AutoTokenizer.from_pretrained(name, cache_dir=model_args.cache_dir)
    vocab = model_args.tokenizer_vocab_size or preset.tokenizer_vocab
    return train_tokenizer(texts(), vocab, block_size or preset.block_size)


def resolve_block_size(requested: int | None, default: int, config) -> int:
    """``--block_size``, else ``default``; never more than the model's positions."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if requested is None:
        return min(default, positions or default)
    if positions is not None and requested > positions:
        raise SystemExit(
            f"--block_size {requested} is more than the model's {positions} positions: pass at most {positions}"
        )
    return requested


def build_model(model_args: ModelArguments, tokenizer, rank0_only: bool) -> torch.nn.Module:
    """``rank0_only`` (Elixir on): no rank holds a copy per process: a local safetensors folder is
    streamed into each rank's shards, a new model's init drawn in them (else rank 0 reads the weights
    and the others build on meta); ``elixir_hf.loading.model`` says which."""
    if model_args.model_name_or_path is not None:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        # fp32 master weights: the engine computes in --bf16/--fp16 and keeps fp32 copies to update
        model = elixir_hf.from_pretrained(
            AutoModelForCausalLM,
            model_args.model_name_or_path,
            rank0_only=rank0_only,
            config=config,
            cache_dir=model_args.cache_dir,
            dtype=torch.float32,
        )
    else:
        preset = PRESETS[model_args.model_size]
        config = GPT2Config(
            vocab_size=max(preset.vocab_size, len(tokenizer)),
            n_positions=preset.n_positions,
            n_embd=preset.n_embd,
            n_layer=preset.n_layer,
            n_head=preset.n_head,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=False,
        )
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = elixir_hf.from_config(AutoModelForCausalLM, config, rank0_only=rank0_only)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return model


def truncate(split, n: int):
    """run_clm's ``--max_*_samples``: the first ``n`` blocks."""
    return split.take(n) if isinstance(split, datasets.IterableDataset) else split.select(range(min(n, len(split))))


def main() -> None:
    model_args, data_args, training_args = parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
    if model_args.model_name_or_path is not None and model_args.model_size is not None:
        raise SystemExit("--model_size builds a new model and --model_name_or_path loads one: pass only one")
    if model_args.model_name_or_path is None:
        model_args.model_size = model_args.model_size or ("gpt2" if ON_GPU else "tiny")
        if model_args.model_size not in PRESETS:
            raise SystemExit(f"--model_size {model_args.model_size!r} is not one of {list(PRESETS)}")
    preset = PRESETS.get(model_args.model_size)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="raw dataset and tokenizer"):
        raw = load_raw(data_args, model_args.cache_dir)
        texts = functools.partial(training_texts, raw, data_args.streaming)  # read only to train a BPE
        tokenizer = build_tokenizer(model_args, preset, texts, data_args.block_size)
    model = build_model(model_args, tokenizer, rank0_only=training_args.elixir_plugin is not None)
    default_block = preset.block_size if preset else min(1024, tokenizer.model_max_length)
    block_size = resolve_block_size(data_args.block_size, default_block, model.config)
    with training_args.main_process_first(desc="tokenizing and grouping"):
        blocks = lm_datasets(raw, tokenizer, block_size, data_args.preprocessing_num_workers, data_args.overwrite_cache)
    train_set, eval_set = blocks["train"], blocks["validation"]
    if data_args.max_train_samples is not None:
        train_set = truncate(train_set, data_args.max_train_samples)
    if data_args.max_eval_samples is not None:
        eval_set = truncate(eval_set, data_args.max_eval_samples)

    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "model %s: %.1fM parameters; %s train / %s validation blocks of %d tokens",
        model_args.model_name_or_path or model_args.model_size,
        n_params / 1e6,
        "streamed" if data_args.streaming else len(train_set),
        "streamed" if data_args.streaming else len(eval_set),
        block_size,
    )

    trainer = RecipeTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set if training_args.do_train else None,
        eval_dataset=eval_set if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
