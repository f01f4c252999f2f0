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
from typing import Any

import torch
from torch import nn

from .harness import (
    ELIXIR_TRAINERS,
    LR,
    MAX_GRAD_NORM,
    STOCK_TRAINERS,
    SYSTEMS,
    TRAINER_SYSTEMS,
    WEIGHT_DECAY,
    Context,
    Trainer,
    Unavailable,
    plan_summary,
)
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


def build(system: str, p: Model, ctx: Context, example_ids: torch.Tensor) -> Trainer:
    builders: dict[str, Callable[[], Trainer]] = {
        "elixir": lambda: _elixir(p, ctx, example_ids),
        "plain": lambda: _plain(p, ctx),
        "fsdp2": lambda: _fsdp2(p, ctx, offload=False),
        "fsdp2_offload": lambda: _fsdp2(p, ctx, offload=True),
        "ds2_offload": lambda: _deepspeed(p, ctx, stage=2, micro_batch=len(example_ids)),
        "ds3_offload": lambda: _deepspeed(p, ctx, stage=3, micro_batch=len(example_ids)),
        "ds3_partial": lambda: _deepspeed(p, ctx, stage=3, micro_batch=len(example_ids), ratio=ctx.ds_ratio),
    }
    if system in TRAINER_SYSTEMS:
        return _hf(p, ctx, system)
    if system not in builders:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    return builders[system]()


def _hf(p: Model, ctx: Context, system: str) -> Trainer:
    from .hf_systems import hf_trainer  # transformers' Trainer: imported only where it runs

    if system in ELIXIR_TRAINERS:
        return hf_trainer(p, ctx, elixir=True, moments=ELIXIR_TRAINERS[system])
    return hf_trainer(p, ctx, elixir=False, stock=STOCK_TRAINERS[system])


def _adamw(params, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)


def _elixir(p: Model, ctx: Context, example_ids: torch.Tensor) -> Trainer:
    """Auto plan for this batch: the planner sizes rCache and offload against the batch's activations."""
    import elixir_runtime as er
    from elixir_hf.commands.plan import DEVICE_LANE_WORDS
    from elixir_hf.loss import use_lean_loss
    from elixir_hf.patches import mask_decisions_of
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
    with mask_decisions_of(batch):
        model, opt = er.prepare(model, opt, config, example_batch=batch, resident=resident)
    from elixir_runtime.plan_view import plan_table

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


def ds_config(stage: int, pin: bool, clip: bool, micro_batch: int, ratio: float | None = None) -> dict[str, Any]:
    """ZeRO-2 (optimizer offload) / ZeRO-3 (param + optimizer offload) to the CPU, bf16, DeepSpeed's
    CPU Adam (its ``AdamW`` with ``offload_optimizer``), ``gradient_clipping`` as ``clip`` says (0: none).
    ``ratio`` (ZeRO-3 only): DeepSpeed's partial offload ("ZeRO-3 Twin-Flow", ``offload_optimizer.ratio``):
    the parameters stay on the GPU, that share of the optimizer states (and their update) on the CPU."""
    offload: dict[str, Any] = {"device": "cpu", "pin_memory": pin}
    if ratio is not None:
        offload["ratio"] = ratio
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": offload,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 2e8,
    }
    if stage == 3:
        if ratio is None:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        zero.update(
            {
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


def _deepspeed(p: Model, ctx: Context, stage: int, micro_batch: int, ratio: float | None = None) -> Trainer:
    try:
        import deepspeed
    except ImportError as exc:
        raise Unavailable("deepspeed not installed") from exc
    config = ds_config(stage, ctx.ds_pin, ctx.clip, micro_batch, ratio)
    if stage == 3:
        # Partitioned at construction; HF's init then sees empty params, so fill the partitions here.
        remote = "cpu" if ratio is None else None  # partial offload: the parameters on the GPU
        with deepspeed.zero.Init(
            config_dict_or_path=config, remote_device=remote, pin_memory=ctx.ds_pin, dtype=torch.bfloat16
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
        "offload_optimizer_ratio": ratio,
        "deepspeed": deepspeed.__version__,
        "gradient_clipping": config["gradient_clipping"],
    }
    return Trainer(step, info)
