"""Hugging Face integration of the Elixir engine: one argument for Trainer users, one class for
Accelerate users. ``elixir_runtime`` does the work; this package only adapts it.

    args = ElixirTrainingArguments(output_dir="out", elixir="auto", bf16=True)   # or --elixir auto
    ElixirTrainer(model=model, args=args, train_dataset=ds).train()

    accelerator = ElixirAccelerator()                                             # instead of Accelerator()

A subclass (TRL's ``SFTConfig``/``SFTTrainer``): ``elixir_args(SFTConfig)``, ``elixir_trainer(SFTTrainer)``.
No edit at all: ``elixir-run train.py [its arguments] --elixir auto`` (``elixir_hf.run``).

On several ranks, ``from_pretrained(AutoModelForCausalLM, path, dtype=...)`` loads on rank 0 only
(the others build on meta and get rank 0's weights when the engine is built): one host copy.
"""

from .accelerator import ElixirAccelerator, elixir_accelerator
from .arguments import ElixirTrainingArguments, elixir_args
from .generate import GenerateCallback
from .loading import from_config, from_pretrained
from .plugin import ElixirPlugin, ElixirSpecError
from .trainer import ElixirTrainer, elixir_trainer

__all__ = [
    "ElixirAccelerator",
    "ElixirPlugin",
    "ElixirSpecError",
    "ElixirTrainer",
    "ElixirTrainingArguments",
    "GenerateCallback",
    "elixir_accelerator",
    "elixir_args",
    "elixir_trainer",
    "from_config",
    "from_pretrained",
]
