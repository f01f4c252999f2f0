"""Hugging Face integration of the Elixir engine: one argument for Trainer users, one class for
Accelerate users. ``elixir_runtime`` does the work; this package only adapts it.

    args = ElixirTrainingArguments(output_dir="out", elixir="auto", bf16=True)   # or --elixir auto
    ElixirTrainer(model=model, args=args, train_dataset=ds).train()

    accelerator = ElixirAccelerator()                                             # instead of Accelerator()

A subclass (TRL's ``SFTConfig``/``SFTTrainer``): ``elixir_args(SFTConfig)``, ``elixir_trainer(SFTTrainer)``.
No edit at all: ``elixir-run train.py [its arguments] --elixir auto`` (``elixir_hf.commands.run``).

``from_pretrained(AutoModelForCausalLM, path, dtype=...)`` streams a local safetensors folder into
each rank's chunk shards when the engine is built (else rank 0 reads it, the others build on meta),
and ``from_config`` draws a new model's init there: no host copy of the model per rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``, the one source); in a
    source tree that is not installed, pyproject.toml's own."""
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("elixir-hf")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        version: str = tomllib.loads(pyproject.read_text())["project"]["version"]
        return version
    except (OSError, KeyError, ValueError):
        return "0+unknown"


__version__ = _version()

_EXPORTS = {
    "ElixirAccelerator": "accelerator",
    "elixir_accelerator": "accelerator",
    "ElixirTrainingArguments": "arguments",
    "elixir_args": "arguments",
    "GenerateCallback": "generate",
    "from_config": "loading.model",
    "from_pretrained": "loading.model",
    "ElixirPlugin": "plugin",
    "ElixirSpecError": "plugin",
    "ElixirTrainer": "trainer",
    "elixir_trainer": "trainer",
}
"""Each public name and the module that defines it, imported on first use (PEP 562): the Trainer
and Accelerate modules pull in transformers' trainer stack (and PEFT where installed), 6 s of a
9 s import on a 2-core machine, which ``elixir-plan``, the loss and the harness's workers never use
(``import elixir_hf.commands.plan``: 3.4 s instead of 9)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from .accelerator import ElixirAccelerator, elixir_accelerator
    from .arguments import ElixirTrainingArguments, elixir_args
    from .generate import GenerateCallback
    from .loading.model import from_config, from_pretrained
    from .plugin import ElixirPlugin, ElixirSpecError
    from .trainer import ElixirTrainer, elixir_trainer
