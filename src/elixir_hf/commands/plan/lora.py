"""``elixir-plan --lora``: the model a LoRA fine-tune trains, built by PEFT on the meta device.

The planner is given the ``PeftModel`` itself, not a formula: its base parameters frozen (frozen
chunks: the compute-dtype weights only, no gradient, no Adam state, offloadable as any chunk) and its
adapters trainable, as a run with ``get_peft_model`` or TRL's ``peft_config`` prepares it (docs/hf.md).
The adapters take the base's dtype (``autocast_adapter_dtype=False``): the engine computes in one dtype
and keeps the fp32 master of every trainable parameter itself, so PEFT's fp32 cast changes nothing
the plan counts but the profile's activations.
"""

from __future__ import annotations

import argparse
import typing
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at use, not import: elixir-plan --help answers without it (__init__.py)
    from torch import nn

__all__ = ["LORA_RANK", "LORA_TARGETS", "PEFT_EXTRA", "Lora", "lora_of", "lora_model", "lora_targets"]

LORA_RANK = 16
LORA_TARGETS = "all-linear"
"""PEFT's name for every linear layer but the output head: attention's q/k/v/o and the MLP's."""
PEFT_EXTRA = "pip install 'elixir-hf[trl]'"
_LINEAR = ("Linear", "Conv1D")  # Conv1D: GPT-2's linear layers (transformers.pytorch_utils)


@dataclass(frozen=True)
class Lora:
    """The adapters ``--lora`` asks for: their rank and the modules they wrap."""

    rank: int
    targets: str | list[str]

    def text(self) -> str:
        where = "every linear layer but the head" if self.targets == LORA_TARGETS else ", ".join(self.targets)
        return f"LoRA rank {self.rank} on {where}"


def lora_targets(text: str) -> str:
    """``--lora-targets``: comma-separated module names, at least one (an empty value planned a full fine-tune)."""
    if not any(t.strip() for t in text.split(",")):
        raise argparse.ArgumentTypeError(
            f"names no module: {text!r}; give some, e.g. q_proj,v_proj, or leave it out for {LORA_TARGETS}"
        )
    return text


def lora_of(args: argparse.Namespace) -> Lora | None:
    """The command line's LoRA (``--lora``, or ``--lora-rank``/``--lora-targets``, which imply it); ``None``:
    a full fine-tune."""
    if not (args.lora or args.lora_rank or args.lora_targets):
        return None
    targets = args.lora_targets or LORA_TARGETS
    names = targets if targets == LORA_TARGETS else [t.strip() for t in targets.split(",") if t.strip()]
    return Lora(args.lora_rank or LORA_RANK, names)


def lora_model(model: nn.Module, lora: Lora) -> nn.Module:
    """``model`` (built on meta) wrapped by PEFT with ``lora``'s adapters; a target that names no module
    (PEFT refuses only where none of them does) is a ``ValueError`` naming the flag and the model's linear
    layers."""
    from peft import LoraConfig, get_peft_model

    names = [n for n, _ in model.named_modules()]
    if lora.targets != LORA_TARGETS and (
        missing := [t for t in lora.targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    ):
        _unknown_targets(model, lora, f"{', '.join(missing)} names no module of the model")
    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D: PEFT says it sets fan_in_fan_out, as it must
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
            return get_peft_model(
                model, LoraConfig(r=lora.rank, target_modules=lora.targets), autocast_adapter_dtype=False
            )
    except ValueError as exc:
        _unknown_targets(model, lora, str(exc))


def _unknown_targets(model: nn.Module, lora: Lora, why: str) -> typing.NoReturn:
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in _LINEAR})
    raise ValueError(
        f"--lora-targets {','.join(lora.targets)}: {why}; this model's linear layers: {', '.join(linear)} "
        f"(or {LORA_TARGETS}, the default)"
    )
