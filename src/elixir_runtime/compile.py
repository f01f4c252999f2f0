"""``torch.compile`` under the engine: each block's forward compiled, the chunk hooks outside.

[Note: regional compilation] The engine gathers and releases chunks in module hooks, which run in
``nn.Module._call_impl`` around ``forward``: compiling a whole model (``torch.compile(model)``, or a
block's ``Module.compile()``, which compiles ``_call_impl``) would trace those hooks, their
collectives, streams and Python state. ``compile_blocks`` compiles the ``forward`` of each block of
the model's identical stack instead (torchtitan's per-block compilation), so every hook runs eagerly
around compiled code and the parameters the code reads are the rCache views the pre-forward hook
just made. Dynamo treats the parameters of an inlined module as graph inputs and guards their
shape, stride and dtype, not their address, so one graph serves every block and every gather (the
identical blocks compile once). A checkpointed block's recomputation is inside the compiled code
(transformers checkpoints inside ``forward``) and its chunks are pinned from pre-backward to
post-backward as in eager. CUDA graphs cannot work: a graph replays the addresses it recorded, and
the engine points the parameters at another rCache buffer on each gather, so ``mode``
``"reduce-overhead"``/``"max-autotune"`` and the ``cudagraphs`` backend are refused.

Compiled code never runs under the first forward's placeholder watch (``runtime/hooks.py``) nor in
the plan's fake trace (``profiler/fake.py``): both force eager mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .config import ConfigError
from .profiler.blocks import find_block_stack

__all__ = ["CompileStats", "compile_blocks", "compile_stats", "check_compile_options"]

_R = TypeVar("_R")

_CUDA_GRAPHS = "CUDA graphs replay the parameter addresses they recorded, and the engine re-points them at each gather"


def check_compile_options(
    backend: Any = "inductor", mode: str | None = None, options: dict[str, object] | None = None
) -> None:
    """Refuses what cannot work with the engine's chunk hooks, naming the option and the fix."""
    if mode in ("reduce-overhead", "max-autotune"):
        raise ConfigError(
            f"torch.compile mode={mode!r} uses CUDA graphs, which cannot work with Elixir ({_CUDA_GRAPHS}): use "
            f"mode='max-autotune-no-cudagraphs' or the default mode"
        )
    if isinstance(backend, str) and backend == "cudagraphs":
        raise ConfigError(
            f"torch.compile backend='cudagraphs' cannot work with Elixir ({_CUDA_GRAPHS}): use 'inductor'"
        )
    if options and options.get("triton.cudagraphs"):
        raise ConfigError(
            f"torch.compile options={{'triton.cudagraphs': True}} cannot work with Elixir ({_CUDA_GRAPHS}): drop it"
        )


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compiles the ``forward`` of every block of ``model``'s stack of identical blocks (the decoder
    layers) with ``torch.compile(**compile_kwargs)``; returns how many. Call it on a model
    ``elixir_runtime.prepare`` returned, in place of ``torch.compile(model)``."""
    if not hasattr(model, "_elixir"):
        raise ValueError("compile_blocks compiles a prepared model: call elixir_runtime.prepare(model, ...) first")
    check_compile_options(
        compile_kwargs.get("backend", "inductor"), compile_kwargs.get("mode"), compile_kwargs.get("options")
    )
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"{type(model).__name__} has no stack of identical blocks to compile one by one: compile_blocks needs "
            "the decoder layers of a transformer (an nn.ModuleList of one class)"
        )
    blocks = stack.blocks
    for block in blocks:
        if "forward" in block.__dict__:
            raise ValueError(f"{stack.prefix} blocks are compiled already (their forward is set on the instance)")
    for block in blocks:
        block.forward = _checkpoint_side_effects_unreplayed(torch.compile(block.forward, **compile_kwargs))
    return len(blocks)


_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _checkpoint_side_effects_unreplayed(compiled: Callable[..., _R]) -> Callable[..., _R]:
    """``compiled`` traced with dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` set, where
    this torch has it.

    [Note: side effects under checkpoint] transformers >= 5.25 checkpoints inside a layer's
    ``forward``, and that forward sets a module-level collector (``output_capturing._active_collector``,
    hidden states for ``output_hidden_states``). Dynamo will not trace a mutation of outer state inside
    the checkpoint's higher-order op unless told the backward's recomputation may skip it: without the
    flag the whole block falls back to eager (a graph break, no graph). Recomputing a training forward
    needs only its tensors, not the collector, so the flag is set for the blocks' compiled code only."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, _SKIP_REPLAY):
        return compiled

    def forward(*args: object, **kwargs: object) -> _R:
        with dynamo_config.patch(_SKIP_REPLAY, True):
            return compiled(*args, **kwargs)

    return forward


@dataclass(frozen=True)
class CompileStats:
    """What dynamo did in this process so far."""

    graphs: int
    """Distinct graphs compiled (identical blocks share one)."""
    graph_breaks: int
    """Graph breaks, each a return to eager inside a compiled forward."""
    break_reasons: dict[str, int]
    compile_s: float
    """Seconds spent compiling (dynamo's trace and the backend's compile), the cold start."""


def compile_stats() -> CompileStats:
    from torch._dynamo.utils import compilation_time_metrics, counters

    breaks = {str(k): int(v) for k, v in counters["graph_break"].items()}
    return CompileStats(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=sum(breaks.values()),
        break_reasons=breaks,
        compile_s=float(sum(compilation_time_metrics.get("_compile.compile_inner", []))),
    )
