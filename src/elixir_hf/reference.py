"""A model prepared for evaluation only (TRL's reference model) on an engine of its own: frozen chunks.

TRL's preference trainers (``DPOTrainer``; those sharing its reference path) hand their reference
model to ``accelerator.prepare_model(ref_model, evaluation_mode=True)``. Under Elixir that model
gets an engine of its own (``frozen_engine``): every parameter frozen, so its chunks hold the
compute-dtype weights only (bf16 under ``--bf16``: 2 bytes per parameter; no gradient, no master
copy, no optimizer state), ``ElixirPlugin.reference_offload`` of them in (pinned) host memory,
gathered for each forward through the smallest rCache, sharded over the ranks as the trained
model's are.

[Note: the reference's plan]
The reference is built in the trainer's ``__init__``, before the trained model's engine (planned in
``train()``), so the trained model's plan sees the GPU and host memory the reference left, as free
memory measured then. The reference's own plan is static and small by design: the trained model's
state is 8 times the reference's per parameter (16 bytes against 2), so the GPU goes to it first;
a frozen chunk in host memory costs only its upload per forward, overlapped with the forward by the
prefetch. ``reference_offload: 0`` keeps every reference chunk on the GPU (no uploads) where both
fit. Not priced by the trained model's plan: the reference forward's own activations (no
gradients: one layer's at a time, beside the trained forward's kept ones).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

import elixir_runtime
from elixir_runtime.plan_view import plan_table

from .engine import engine_state, read_outside_modules
from .plugin import ElixirPlugin, describe_model

__all__ = ["frozen_engine"]

logger = logging.getLogger(__name__)


def frozen_engine(model: nn.Module, plugin: ElixirPlugin, device: torch.device) -> nn.Module:
    """Puts ``model`` on an engine of frozen chunks ([Note: the reference's plan]), in place: its
    parameters lose ``requires_grad`` (it is evaluated, never trained), its forward gathers them. The
    plugin's dtype, chunk size, prefetch and lockstep timeout apply; its plan file (the trained model's)
    does not."""
    for p in model.parameters():
        p.requires_grad_(False)
    config = plugin.config
    config = dataclasses.replace(
        config,
        mode="static",
        n_blocks="min",
        offload=plugin.reference_offload,
        device=device,
        device_assisted_update=False,
        record_update_rate=False,
    )
    resident = read_outside_modules(model)  # TRL's fused LM head: the reference gets one too
    no_state = torch.optim.AdamW([{"params": []}])  # the engine's optimizer, over no parameter
    elixir_runtime.prepare(model, no_state, config=config, resident=resident)
    if logger.isEnabledFor(logging.INFO):
        m = describe_model(model)
        plan = engine_state(model).plan
        logger.info(
            "Elixir plan for the reference %s (%.1fM parameters, frozen, %d of %d chunks in host memory):\n%s",
            m["class"],
            m["parameters"] / 1e6,
            len(plan.offload),
            len(plan.chunks),
            plan_table(plan),
        )
    return model
