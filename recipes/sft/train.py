#!/usr/bin/env python
"""Full fine-tune (SFT) of a chat model with the Elixir engine under the HF Trainer: one script, a
YAML of settings per model (``configs/``: Llama-3.1-8B, Qwen2.5-7B, Qwen2.5-14B, Mistral-7B-v0.3).

    python recipes/sft/train.py --recipe llama3.1-8b                        # one GPU
    torchrun --nproc_per_node 2 recipes/sft/train.py --recipe qwen2.5-14b   # the GPUs of one host
    accelerate launch --config_file recipes/elixir.yaml recipes/sft/train.py --recipe mistral-7b-v0.3
    python recipes/sft/train.py --recipe qwen2.5-7b --dataset my_chats.jsonl --max_steps 100

The model is loaded by its Hub id (or a local folder) through ``elixir_hf.from_pretrained``: its
weights go to each rank's chunk shards, no rank holds a copy of the model. The data is a
``datasets`` dataset of conversations (``chat_data.py``), rendered by the tokenizer's chat template,
the loss on the answer tokens only. ``--elixir auto`` (the default) plans the run for the GPU, its
host memory and the longest example; ``--elixir off`` is the stock Trainer (which an 8B full
fine-tune does not fit on one 80 GB GPU). Every ``TrainingArguments`` field is an argument too;
the arguments are parsed by TRL's ``TrlParser`` (``--recipe NAME`` is its ``--config configs/NAME.yaml``):
the command line wins over the recipe's YAML, which wins over ``training_defaults``. The YAML's
``elixir`` key is ``--elixir``'s value (a mapping of its JSON keys, ``auto``, ``off``); a bad one stops
the script naming the key and the file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from chat_data import IGNORE, load_source, sft_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, set_seed
from trl import TrlParser

import elixir_hf
from elixir_hf import ElixirTrainer, ElixirTrainingArguments
from elixir_hf.config_file import elixir_key
from elixir_hf.plugin import ElixirPlugin, ElixirSpecError

logger = logging.getLogger("sft-recipe")
ON_GPU = torch.cuda.is_available()
CONFIGS = Path(__file__).resolve().parent / "configs"
RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


@dataclass
class SFTArguments:
    recipe: str | None = field(
        default=None,
        metadata={
            "help": f"A model's settings: one of {RECIPES}, or a YAML file of these arguments (= --config FILE)."
        },
    )
    model_name_or_path: str | None = field(default=None, metadata={"help": "A Hub id or a local model folder."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Another tokenizer (one with a chat template, for a base model)."}
    )
    dataset: str = field(
        default="yahma/alpaca-cleaned",
        metadata={"help": "A Hub dataset id or a local .json/.jsonl/.csv/.parquet file or data folder."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    dataset_split: str = field(default="train", metadata={"help": "The split trained on (a Hub dataset's)."})
    max_seq_length: int = field(default=2048, metadata={"help": "Tokens per conversation at most (cut beyond)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N conversations."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloads are cached."})


def training_defaults(recipe: str | None) -> dict:
    """What every SFT recipe shares: one epoch, AdamW at 2e-5 with a cosine schedule, bf16 on GPUs,
    activation checkpointing, a checkpoint every 1000 steps (16 bytes per parameter: weights and
    Adam state), the Elixir plan in the log."""
    names = {f.name for f in fields(ElixirTrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return dict(
        output_dir=str(Path("runs") / "sft" / Path(recipe or "model").stem),
        elixir=os.environ.get("ELIXIR_CONFIG", "auto"),
        num_train_epochs=1,
        learning_rate=2e-5,
        lr_scheduler_type="cosine",
        warmup_steps=0.03,
        weight_decay=0.0,
        logging_steps=10,
        log_level="info",  # the Elixir plan, the Trainer's run summary
        save_strategy="steps",
        save_steps=1000,
        save_total_limit=1,
        bf16=ON_GPU and torch.cuda.is_bf16_supported(),
        dataloader_pin_memory=ON_GPU,
        **{checkpointing: True},
    )


def recipe_file(recipe: str) -> Path:
    """The YAML of ``--recipe``: a name in ``configs/`` or a file."""
    path = Path(recipe) if recipe.endswith((".yaml", ".yml")) else CONFIGS / f"{recipe}.yaml"
    if not path.is_file():
        raise SystemExit(f"--recipe {recipe}: no such file ({path}); pass one of {RECIPES} or a YAML file")
    return path


def parse_args(argv: Sequence[str] | None = None) -> tuple[SFTArguments, ElixirTrainingArguments]:
    """TRL's ``TrlParser``: ``--recipe NAME`` is its ``--config configs/NAME.yaml`` (every key an argument of
    this script, an unknown one refused; an ``env:`` mapping sets environment variables), the command
    line over the file over ``training_defaults``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--recipe")
    first.add_argument("--config")
    given = first.parse_known_args(argv)[0]
    if given.recipe and given.config:
        raise SystemExit("pass --recipe (a name or a YAML file) or --config (a YAML file), not both")
    path = recipe_file(given.recipe) if given.recipe else given.config
    parser = TrlParser((SFTArguments, ElixirTrainingArguments))
    parser.set_defaults(**training_defaults(given.recipe or given.config))
    if path is not None:
        found = elixir_key(str(path))
        if found is not None:  # a bad value named with its key and file, before the arguments read it as --elixir's
            source, spec = found
            try:
                ElixirPlugin.from_spec(spec, source)
            except ElixirSpecError as exc:
                raise SystemExit(str(exc)) from None
        if given.recipe:
            argv += ["--config", str(path)]
    try:
        sft_args, training_args = parser.parse_args_and_config(argv)
    except ValueError as exc:
        if "from config file" not in str(exc):
            raise
        raise SystemExit(f"{path}: {exc} (see recipes/sft/train.py --help)") from None
    if sft_args.model_name_or_path is None:
        raise SystemExit(f"no model: pass --recipe (one of {RECIPES}) or --model_name_or_path")
    return sft_args, training_args


def main(argv: Sequence[str] | None = None) -> None:
    sft_args, training_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="dataset and tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(
            sft_args.tokenizer_name or sft_args.model_name_or_path, cache_dir=sft_args.cache_dir
        )
        if tokenizer.pad_token is None:  # padding is masked out of attention and loss
            tokenizer.pad_token = tokenizer.eos_token
        raw = load_source(sft_args.dataset, sft_args.dataset_config_name, sft_args.dataset_split, sft_args.cache_dir)
        if sft_args.max_train_samples is not None:
            raw = raw.select(range(min(sft_args.max_train_samples, len(raw))))
        train_set = sft_dataset(raw, tokenizer, sft_args.max_seq_length, sft_args.preprocessing_num_workers)

    # fp32 master weights: the engine computes in --bf16 and keeps fp32 copies to update
    model = elixir_hf.from_pretrained(
        AutoModelForCausalLM,
        sft_args.model_name_or_path,
        rank0_only=training_args.elixir_plugin is not None,
        cache_dir=sft_args.cache_dir,
        dtype=torch.float32,
    )
    logger.info(
        "%s: %.2f B parameters; %d conversations, %d answer tokens",
        sft_args.model_name_or_path,
        sum(p.numel() for p in model.parameters()) / 1e9,
        len(train_set),
        sum(sum(label != IGNORE for label in labels) for labels in train_set["labels"]),
    )

    trainer = ElixirTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE),
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
