"""What every system of the throughput table shares, below the modules that build them
(``systems.py``, ``hf_systems.py``): the names of the systems and the stock Trainer's baselines,
the hyper-parameters every one trains with, the ``Context`` a system is built for and the
``Trainer`` it is built into, and the plan's summary the results keep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from elixir_runtime import ElixirPlan

LR, WEIGHT_DECAY = 1e-4, 0.01
MAX_GRAD_NORM = 1.0
"""``TrainingArguments.max_grad_norm``'s default: the clip every system applies with ``--clip 1``."""


@dataclass(frozen=True)
class StockTrainer:
    """A baseline run by the stock HF ``Trainer`` (``hf_systems.py``): the weights it is given, its optimizer."""

    weights: torch.dtype = torch.float32
    """The model's dtype: fp32 (bf16 autocast over fp32 master weights, the numerics Elixir keeps) or
    bf16 (no fp32 copy: the update rounds to bf16)."""
    optim: str | None = None
    """``TrainingArguments.optim``; ``None``: the Trainer's default AdamW."""
    cpu_offload: bool = False
    """The Trainer is given ``torchao.optim.CPUOffloadOptimizer(AdamW, fused=True)`` over the model on the
    GPU: the update and its states on the CPU."""
    package: str | None = None
    """The package the optimizer comes from (import and pip name alike); missing: the row says n/a."""


STOCK_TRAINERS = {
    "trainer": StockTrainer(),
    "trainer_lossy": StockTrainer(torch.bfloat16, optim="paged_adamw_8bit", package="bitsandbytes"),
    "torchao_offload": StockTrainer(cpu_offload=True, package="torchao"),
    "torchao_offload_bf16": StockTrainer(torch.bfloat16, cpu_offload=True, package="torchao"),
}
"""``trainer``: fp32 weights, the Trainer's AdamW on the GPU; ``trainer_lossy``: bf16 weights and
bitsandbytes' paged 8-bit AdamW (lossy states and updates); ``torchao_offload(_bf16)``: torchao's CPU
offload of AdamW over fp32 (bf16) weights."""
ELIXIR_TRAINERS = {"elixir_trainer": "fp32", "elixir_trainer_8bit": "8bit"}
"""HF ``Trainer.train()`` with ``--elixir auto``, by the moments it keeps (``ElixirConfig.moments``)."""
TRAINER_SYSTEMS = (*ELIXIR_TRAINERS, *STOCK_TRAINERS)
"""HF ``Trainer.train()`` with ``--elixir auto`` and the stock Trainer's baselines: what ``--liger`` and ``--compile`` reach."""
SYSTEMS = ("elixir", "plain", "fsdp2", "fsdp2_offload", "ds2_offload", "ds3_offload", "ds3_partial", *TRAINER_SYSTEMS)


class Unavailable(RuntimeError):
    """The system cannot be built on this machine at all (e.g. DeepSpeed is not installed)."""


def packages(stock: StockTrainer | None, liger: bool) -> list[tuple[str, str]]:
    """(module, pip name) of each package a Trainer-path system imports beyond the package's own requirements:
    Liger's kernels (``liger``: ``use_liger_kernel``), its optimizer's (``stock``'s; ``None``: Elixir's own)."""
    needed = [("liger_kernel", "liger-kernel")] if liger else []
    return needed + ([(stock.package, stock.package)] if stock is not None and stock.package is not None else [])


def not_installed(package: str, why: object) -> str:
    """An ``unavailable`` row's error: ``package`` missing (``why``), and the fix."""
    return (
        f"{package} not installed ({why}): pip install {package}, or on an offline GPU machine the wheels of "
        "benchmarks/make_fused_wheels.sh"
    )


def on_trainer_path(system: str, flag: bool) -> bool:
    """Whether a ``TrainingArguments`` switch (``--liger``: ``use_liger_kernel``, ``--compile``:
    ``torch_compile``) reaches ``system``: only the Trainer-path systems have those arguments."""
    return flag and system in TRAINER_SYSTEMS


@dataclass(frozen=True)
class Context:
    device: torch.device
    world: int
    rank: int
    seq: int
    ds_pin: bool = True
    ds_ratio: float = 0.5
    """``ds3_partial``'s ``offload_optimizer.ratio``: the share of optimizer states DeepSpeed keeps on the CPU."""
    threads: int | None = None
    """This rank's CPU threads (``--threads``); Elixir's CPU Adam keeps one of them for the loop."""
    clip: bool = True
    """Clip gradients to ``MAX_GRAD_NORM`` before every update (``--clip``)."""
    skip_nonfinite: bool = True
    """Elixir's non-finite step check (``ElixirConfig.skip_nonfinite``): reads the gradient norm every
    step, a host sync before the update, so the offloaded chunks' CPU Adam starts after backward."""
    device_lane: str = "off"
    """Elixir's device update lane (``ElixirConfig.device_assisted_update``: ``auto``, ``on``, ``off``)."""
    offload: float | None = None
    """Elixir's offloaded fraction of chunks, pinned (``ElixirConfig.offload``); ``None``: the plan's choice."""
    lean_loss: bool = True
    """Elixir's model gets the lean causal-LM loss, as ``ElixirTrainer`` installs it by default
    (``elixir_hf.loss``; ``--lean-loss``); the baselines keep transformers' own."""
    fused_head: bool = False
    """Elixir's model reads its LM head's weight outside the head module, as TRL's fused LM head does
    (``models.use_fused_head``), and passes it to ``prepare`` as ``resident``."""
    liger: bool = False
    """The Trainer-path systems set ``use_liger_kernel=True``: the Trainer patches Liger's Triton kernels
    (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) into the model (``--liger``)."""
    compile: bool = False
    """The Trainer-path systems set ``torch_compile=True`` (``--compile``): Elixir compiles each decoder
    layer (``elixir_runtime.compile_blocks``), the stock Trainer the whole model (Accelerate's dynamo)."""


@dataclass
class Trainer:
    step: Callable[[torch.Tensor], torch.Tensor] | None = None
    """One optimizer step on ``input_ids`` (labels = inputs); returns the loss. ``None`` where ``timed`` runs the loop."""
    info: dict[str, Any] = field(default_factory=dict)
    after_oom: Callable[[], None] = lambda: None
    """Frees what a step left behind when it ran out of memory, so a smaller retry is possible."""
    handles: dict[str, Any] = field(default_factory=dict)
    """Objects a tool may look into (Elixir: ``model``, ``optimizer``); never reported."""
    timed: Callable[[torch.Tensor, int, int], tuple[list[float], float]] | None = None
    """Runs its own loop over ``input_ids`` instead of ``step``: ``(ids, warmup, steps)`` -> (timed steps' seconds,
    loss); the Trainer-path systems, whose loop is ``Trainer.train()``."""


def plan_summary(plan: ElixirPlan) -> dict[str, Any]:
    """The plan's scalar fields, memory and predicted step, for the results file; with the offloaded
    chunks and the hardware profile, enough for ``benchmarks.replay`` to predict it again."""
    saved = plan.to_dict()
    out = {k: v for k, v in saved.items() if v is None or isinstance(v, (bool, int, float, str))}
    out.update(
        memory=saved["memory"],
        n_offloaded=len(plan.offload),
        offload=list(plan.offload),
        device_bytes=plan.device_bytes,
        host_bytes=plan.host_bytes,
        predicted_step_s=plan.predicted_step_s,
        predicted=saved["predicted"],
        rates=saved["search"].get("rates"),
        hardware=saved["search"].get("hardware"),
    )
    return out
