"""The systems compared in the throughput table, each built into a ``Trainer`` that runs full steps.

Every system trains the same HF model with the same AdamW hyper-parameters, bf16 compute and
activation checkpointing, and clips gradients to a global L2 norm of ``MAX_GRAD_NORM`` (the HF
Trainer's default ``max_grad_norm``) when ``Context.clip`` is on (``--clip 1``, the default), each
the way its users clip: ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware: FSDP2's norm is all-reduced
over the shards), ``ElixirOptimizer.clip_grad_norm`` (what ``ElixirAccelerator.clip_grad_norm_``
calls for the Trainer), DeepSpeed's ``gradient_clipping``. ``--clip 0`` clips nothing (the GPT-2 rows
measured before the switch existed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .models import (
    Model,
    blocks,
    build_initialised_in_place,
    build_meta,
    causal_lm,
    enable_checkpointing,
    fill_init_,
    materialize,
    restore_buffers_,
    use_fused_head,
)

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
TRAINER_SYSTEMS = ("elixir_trainer", *STOCK_TRAINERS)
"""HF ``Trainer.train()`` with ``--elixir auto`` and the stock Trainer's baselines: what ``--liger`` and ``--compile`` reach."""
SYSTEMS = ("elixir", "plain", "fsdp2", "fsdp2_offload", "ds2_offload", "ds3_offload", *TRAINER_SYSTEMS)


class Unavailable(RuntimeError):
    """The system cannot be built on this machine at all (e.g. DeepSpeed is not installed)."""


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


def build(system: str, p: Model, ctx: Context, example_ids: torch.Tensor) -> Trainer:
    builders: dict[str, Callable[[], Trainer]] = {
        "elixir": lambda: _elixir(p, ctx, example_ids),
        "plain": lambda: _plain(p, ctx),
        "fsdp2": lambda: _fsdp2(p, ctx, offload=False),
        "fsdp2_offload": lambda: _fsdp2(p, ctx, offload=True),
        "ds2_offload": lambda: _deepspeed(p, ctx, stage=2, micro_batch=len(example_ids)),
        "ds3_offload": lambda: _deepspeed(p, ctx, stage=3, micro_batch=len(example_ids)),
    }
    if system in TRAINER_SYSTEMS:
        return _hf(p, ctx, system)
    if system not in builders:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    return builders[system]()


def _hf(p: Model, ctx: Context, system: str) -> Trainer:
    from .hf_systems import hf_trainer  # transformers' Trainer: imported only where it runs

    if system == "elixir_trainer":
        return hf_trainer(p, ctx, elixir=True)
    return hf_trainer(p, ctx, elixir=False, stock=STOCK_TRAINERS[system])


def _adamw(params, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)


def _elixir(p: Model, ctx: Context, example_ids: torch.Tensor) -> Trainer:
    """Auto plan for this batch: the planner sizes rCache and offload against the batch's activations."""
    import elixir_runtime as er
    from elixir_hf.commands.plan import DEVICE_LANE_WORDS
    from elixir_hf.loss import use_lean_loss
    from elixir_runtime.kernels.threads import cpu_adam_threads

    # bf16 weights (the engine keeps fp32 masters itself), on meta on every rank: prepare draws each
    # rank's shards of the model's init on the GPU, as elixir_hf.from_config does; no host copy.
    model = build_initialised_in_place(p, ctx.seq, torch.bfloat16)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the planner reads free GPU memory: return the fill's cached pieces
    batch = {"input_ids": example_ids, "labels": example_ids}
    # clip_grad_norm (or, without clipping, the non-finite check --skip-nonfinite) syncs the host before the update
    # The share of the host the baselines get (--threads), less the core the engine keeps for the loop.
    cpu_threads = cpu_adam_threads(1, cores=ctx.threads) if ctx.threads else None
    config = er.ElixirConfig(
        mode="auto",
        dtype="bf16",
        device=ctx.device,
        clips_grads=ctx.clip,
        cpu_threads=cpu_threads,
        skip_nonfinite=ctx.skip_nonfinite,
        device_assisted_update=DEVICE_LANE_WORDS[ctx.device_lane],
        offload=ctx.offload,
    )
    if ctx.lean_loss:
        use_lean_loss(model)
    resident = use_fused_head(model) if ctx.fused_head else []
    opt = _adamw(model.parameters(), fused=False)
    model, opt = er.prepare(model, opt, config, example_batch=batch, resident=resident)
    from elixir_runtime.planner import plan_table

    plan = model._elixir.plan
    print(plan_table(plan), flush=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        if ctx.clip:
            opt.clip_grad_norm(MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        info["runtime_stats"] = dict(opt.runtime.stats)  # totals since prepare: gathers, elements each update lane took
        return loss

    info = {
        "optimizer": "ElixirOptimizer(AdamW)",
        "cpu_threads": opt.cpu_threads,
        "skip_nonfinite": ctx.skip_nonfinite,
        "device_lane": ctx.device_lane,
        "lean_loss": ctx.lean_loss,
        "fused_head": ctx.fused_head,
        "plan": plan_summary(plan),
        "plan_batch": len(example_ids),
    }
    return Trainer(step, info, handles={"model": model, "optimizer": opt})


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


def _plain(p: Model, ctx: Context) -> Trainer:
    """PyTorch AMP: fp32 params and fused AdamW on the GPU, bf16 autocast; DDP over several GPUs."""
    model = materialize(build_meta(p, ctx.seq), ctx.device, ctx.device)
    opt = _adamw(model.parameters(), fused=True)
    wrapped: nn.Module = model
    if ctx.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        if ctx.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # DDP: the grads are already reduced
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    name = "AdamW(fused=True)" + (" + DDP(gradient_as_bucket_view)" if ctx.world > 1 else "")
    return Trainer(step, {"optimizer": name}, after_oom=lambda: opt.zero_grad(set_to_none=True))


def _fsdp2(p: Model, ctx: Context, offload: bool) -> Trainer:
    """``fully_shard`` per block and at the root on ``meta``, then each rank fills its own shard."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build_meta(p, ctx.seq)
    kwargs: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu" if offload else ctx.device)  # FSDP2 keeps a tied embedding tied
    restore_buffers_(model, ctx.device)  # FSDP2 leaves buffers where they are: the compute device's
    fill_init_(model.named_parameters(), ctx.device, seed=ctx.rank)
    try:
        opt, name = _adamw(model.parameters(), fused=True), "AdamW(fused=True)"
    except (RuntimeError, TypeError):  # fused needs every param on one supported device type
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        name = "AdamW(foreach=True)"

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if ctx.clip:  # DTensor grads: the norm is all-reduced over the shards (CPU ones over gloo: see _worker)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    where = "CPU" if offload else ctx.device.type.upper()
    return Trainer(
        step,
        {"optimizer": f"{name} on {where} shards", "pin_memory": offload},
        after_oom=lambda: opt.zero_grad(set_to_none=True),
    )


def ds_config(stage: int, pin: bool, clip: bool, micro_batch: int) -> dict[str, Any]:
    """ZeRO-2 (optimizer offload) / ZeRO-3 (param + optimizer offload) to the CPU, bf16, DeepSpeed's
    CPU Adam (its ``AdamW`` with ``offload_optimizer``), ``gradient_clipping`` as ``clip`` says (0: none)."""
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": pin},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 2e8,
    }
    if stage == 3:
        zero.update(
            {
                "offload_param": {"device": "cpu", "pin_memory": pin},
                "stage3_prefetch_bucket_size": 2e8,
                "stage3_param_persistence_threshold": 1e5,
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
            }
        )
    else:
        zero["allgather_bucket_size"] = 2e8
    return {
        # the worker's first batch; DeepSpeed feeds it to its timers only, later batch sizes of the worker run as given
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM if clip else 0.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999], "eps": 1e-8},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _deepspeed(p: Model, ctx: Context, stage: int, micro_batch: int) -> Trainer:
    try:
        import deepspeed
    except ImportError as exc:
        raise Unavailable("deepspeed not installed") from exc
    config = ds_config(stage, ctx.ds_pin, ctx.clip, micro_batch)
    if stage == 3:
        # Partitioned at construction; HF's init then sees empty params, so fill the partitions here.
        with deepspeed.zero.Init(
            config_dict_or_path=config, remote_device="cpu", pin_memory=ctx.ds_pin, dtype=torch.bfloat16
        ):
            model = causal_lm(p.config(ctx.seq))
        enable_checkpointing(model)
        fill_init_(((n, q.ds_tensor) for n, q in model.named_parameters()), ctx.device, seed=ctx.rank)
    else:
        model = materialize(build_meta(p, ctx.seq, torch.bfloat16), ctx.device, ctx.device)
    t0 = time.perf_counter()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"deepspeed.initialize {time.perf_counter() - t0:.1f}s", flush=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    info = {
        "optimizer": type(opt).__name__,
        "pin_memory": ctx.ds_pin,
        "deepspeed": deepspeed.__version__,
        "gradient_clipping": config["gradient_clipping"],
    }
    return Trainer(step, info)
