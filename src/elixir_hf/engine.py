"""Builds the Elixir engine on an HF model in place, shared by the Trainer and Accelerate paths."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

import elixir_runtime
from elixir_runtime import ElixirOptimizer, ElixirState
from elixir_runtime.config import PlanMismatch
from elixir_runtime.plan_view import plan_table

from . import patches
from .console import connect_logging
from .loss import use_lean_loss
from .plugin import ElixirPlugin, ElixirSpecError, describe_model

__all__ = [
    "build_engine",
    "clips_grads",
    "engine_state",
    "example_batch",
    "has_engine",
    "read_outside_modules",
    "whole_model",
]

logger = logging.getLogger(__name__)


def has_engine(model: object) -> bool:
    return hasattr(model, "_elixir")


def engine_state(model: nn.Module) -> ElixirState:
    """What ``elixir_runtime.prepare`` attached to ``model`` (``has_engine``)."""
    return cast(ElixirState, model._elixir)


def whole_model(model: nn.Module, rank0_only: bool = False) -> contextlib.AbstractContextManager[nn.Module]:
    """``elixir_runtime.full_params`` for a model the engine runs, nothing for any other (a plain or
    DDP model is whole on every rank already). Enter it on every rank."""
    if has_engine(model):
        return elixir_runtime.full_params(model, rank0_only=rank0_only)
    return contextlib.nullcontext(model)


def read_outside_modules(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``model``'s forward reads without calling the module holding them, which the
    engine must therefore gather itself (``elixir_runtime.prepare(..., resident=...)``): today, the
    output embedding's weight and bias under TRL's fused LM head.

    [Note: TRL's fused LM head] ``trl.trainer.utils.add_fused_lm_head`` (``SFTTrainer``, GRPO, RLOO,
    KTO; TRL >= 1.16) replaces a model's ``forward`` on the instance by ``_fused_forward``: called
    with ``fused_lm_head=True`` it runs the backbone, then multiplies the hidden states by
    ``get_output_embeddings().weight`` in tiles, never calling the head module, whose hooks are where
    the engine gathers a module's chunks. It is recognised by what it is, not by name:
    ``functools.wraps`` gives it the model class's ``forward`` name, qualname and (through
    ``__wrapped__``) signature, so the check reads the instance's own ``forward`` attribute and its
    unwrapped signature, which takes a ``fused_lm_head`` argument. Every module is checked, as PEFT
    patches the model it wraps (``get_base_model()``), not the ``PeftModel``.
    """
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")  # patched on the instance, not the class's own
        if forward is None or not _takes_fused_lm_head(forward):
            continue
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if get_head is not None else None
        for p in (getattr(head, "weight", None), getattr(head, "bias", None)):
            if isinstance(p, nn.Parameter):
                found.setdefault(id(p), p)
    return list(found.values())


def _takes_fused_lm_head(forward: Callable[..., object]) -> bool:
    try:
        return "fused_lm_head" in inspect.signature(forward, follow_wrapped=False).parameters
    except (TypeError, ValueError):  # not introspectable: not TRL's
        return False


def build_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plugin: ElixirPlugin,
    device: torch.device,
    batch: object | None = None,
    *,
    args: object = None,
    grad_accum_steps: int | None = None,
    compile_kwargs: dict[str, Any] | None = None,
) -> ElixirOptimizer:
    """Checks the plan file (if any) names this model, gives the model the lean causal-LM loss
    (``plugin.lean_loss``; before the engine traces a training step, so the plan counts that loss's
    memory), then ``elixir_runtime.prepare``s the model in place, following the plan file (its
    layout checked against the model's before anything is allocated), and logs the plan as a table
    (INFO; ``console.py`` says which processes show it: under the Trainer, rank 0 at
    ``--log_level``, the others at ``--log_level_replica``).

    ``batch`` (one training batch) lets the engine order chunks by first use in forward.
    ``args`` (the ``TrainingArguments``, if any) tells the planner whether the loop clips
    gradients (``clips_grads``); without them it assumes it does. ``grad_accum_steps``: the
    Trainer's or Accelerator's micro-batches per step (``ElixirConfig.grad_accum_steps``).
    ``compile_kwargs`` (``--torch_compile``'s, from the Accelerator's dynamo config): each decoder
    layer's forward is compiled with them (``elixir_runtime.compile_blocks``).
    """
    connect_logging()  # the engine's records (the plan, its warnings) go where transformers' do
    plugin.check_model(model)
    if plugin.lean_loss:
        use_lean_loss(model)
    config = dataclasses.replace(plugin.config, device=device)
    if args is not None:
        config = dataclasses.replace(config, clips_grads=clips_grads(args))
    if grad_accum_steps is not None:
        config = dataclasses.replace(config, grad_accum_steps=grad_accum_steps)
    resident = read_outside_modules(model)
    if resident:
        logger.info(
            "elixir: %d parameters are read outside their module (TRL's fused LM head): they get chunks "
            "of their own that every forward gathers",
            len(resident),
        )
    try:
        with patches.mask_decisions_of(batch):  # the profile traces the attention the run will run
            _, elixir_optimizer = elixir_runtime.prepare(
                model, optimizer, config=config, example_batch=batch, resident=resident, plan=plugin.plan
            )
    except PlanMismatch as exc:  # the plan file's layout is not this model's: a spec error, as the other checks
        raise ElixirSpecError(str(exc)) from None
    plan = engine_state(model).plan
    if compile_kwargs is not None:
        n = elixir_runtime.compile_blocks(model, **compile_kwargs)
        logger.info(
            "elixir: torch.compile(%s) on the forward of each of %d blocks, the chunk hooks outside", compile_kwargs, n
        )
    if logger.isEnabledFor(logging.INFO):
        m = describe_model(model)
        logger.info("Elixir plan for %s (%.1fM parameters):\n%s", m["class"], m["parameters"] / 1e6, plan_table(plan))
    return elixir_optimizer


def clips_grads(args: object) -> bool:
    """Whether a Trainer with these ``TrainingArguments`` syncs the host before each update: it
    clips gradients (``max_grad_norm > 0``, as the Trainer decides) or trains in fp16 (the
    overflow check reads the gradient norm). ``ElixirConfig.clips_grads``: the planner then
    predicts the CPU Adam of offloaded chunks to start after backward, else during it."""
    max_norm = getattr(args, "max_grad_norm", None)
    return bool(getattr(args, "fp16", False)) or (max_norm is not None and max_norm > 0)


def example_batch(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, batch_size: int) -> object:
    """The dataset's first ``batch_size`` examples, collated.

    Read by index (or, from an iterable dataset such as a streamed ``datasets`` one, by iterating
    it afresh), not through a DataLoader: iterating a loader draws a seed from the global RNG,
    which would change the data order and dropout masks compared with a run without Elixir.
    """
    try:
        if hasattr(dataset, "__len__") and not isinstance(dataset, torch.utils.data.IterableDataset):
            items: list[Any] = [dataset[i] for i in range(min(len(dataset), batch_size))]
        else:
            items = list(itertools.islice(dataset, batch_size))
        return collate_fn(items) if collate_fn is not None else torch.utils.data.default_collate(items)
    except Exception as exc:  # unknown dataset/collator shapes: the engine falls back to module order
        logger.info("no example batch for the Elixir trace (%s: %s); module order is used", type(exc).__name__, exc)
        return None
