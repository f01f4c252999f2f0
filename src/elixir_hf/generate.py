"""``GenerateCallback``: samples from fixed prompts on the main process while the Trainer trains.

Sampling on rank 0 only is the usual habit and, with a sharded model, a trap: each forward is a
collective, so a forward on one rank waits for the others (Elixir fails it within 60 s, naming
the fix). This callback does it the supported way: every rank enters ``full_params`` (the other
ranks only help gather, holding no full copy), rank 0 generates alone, every rank leaves
together. It also works on a stock Trainer (DDP), where the model is already whole on each rank::

    trainer.add_callback(GenerateCallback(tokenizer(["Once upon a time"], return_tensors="pt"),
                                          every_n_steps=500, max_new_tokens=40))
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .engine import whole_model

__all__ = ["GenerateCallback"]

logger = logging.getLogger(__name__)


class _Decoder(Protocol):
    """The Trainer's ``processing_class`` as read here: a tokenizer or a processor."""

    def batch_decode(self, sequences: torch.Tensor) -> list[str]: ...


class GenerateCallback(TrainerCallback):
    def __init__(
        self, inputs: Mapping[str, torch.Tensor] | torch.Tensor, every_n_steps: int, **generate_kwargs: object
    ):
        """``inputs``: what ``model.generate`` takes (a tokenizer's output, or ``input_ids``);
        ``generate_kwargs``: the rest of its arguments (``max_new_tokens``, ``do_sample``...)."""
        if every_n_steps < 1:
            raise ValueError(f"GenerateCallback: every_n_steps must be >= 1, got {every_n_steps}")
        self.inputs = dict(inputs) if isinstance(inputs, Mapping) else {"input_ids": inputs}
        self.every_n_steps, self.generate_kwargs = every_n_steps, generate_kwargs
        self.samples: list[tuple[int, torch.Tensor]] = []
        """``(global_step, generated ids on the CPU)``, on the main process."""

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        processing_class: _Decoder | None = None,
        **kwargs: object,
    ) -> None:
        if state.global_step % self.every_n_steps:
            return
        was_training = model.training
        model.eval()
        with whole_model(model, rank0_only=True):  # every rank: the Trainer calls callbacks on each
            if state.is_world_process_zero:
                device = next(model.parameters()).device
                out = model.generate(**{k: v.to(device) for k, v in self.inputs.items()}, **self.generate_kwargs)
                self.samples.append((state.global_step, out.cpu()))
                if processing_class is not None:
                    logger.info("step %d samples: %s", state.global_step, processing_class.batch_decode(out))
        model.train(was_training)
