"""The user's path as systems of the table: HF ``Trainer.train()`` with ``--elixir auto``, and the
stock Trainer's baselines beside it.

``elixir_trainer`` is what a user runs: ``ElixirTrainer`` + ``ElixirTrainingArguments(elixir="auto",
bf16=True)`` over a bf16 model, with the Trainer's defaults (AdamW, linear schedule, clip 1.0 unless
``--clip 0``, the lean loss ``ElixirTrainer`` installs). ``trainer`` is the stock ``Trainer`` with the
same arguments over an fp32 model (mixed precision by autocast, fp32 master weights: the numerics
Elixir keeps) and no Elixir: where it does not fit, its failure is the row. The other stock baselines
(``harness.STOCK_TRAINERS``) change the weights' dtype and the optimizer only: ``trainer_lossy`` bf16
weights and ``optim="paged_adamw_8bit"`` (bitsandbytes); ``torchao_offload`` / ``torchao_offload_bf16``
fp32 / bf16 weights on the GPU and ``optimizers=(CPUOffloadOptimizer(params, AdamW, fused=True), None)``
(torchao): the Trainer's linear schedule wraps it as it is (a ``torch.optim.Optimizer`` subclass whose
``param_groups`` are its inner AdamWs'), but backward's hooks copy each gradient to the host as it is
made, before the Trainer's clip scales the GPU ones, so the CPU update is not clipped (torchao 0.18's
``optim/cpu_offload.py``; ``info["clip_note"]``). ``--liger`` (``Context.liger``) sets
``use_liger_kernel=True`` in every one of them, ``--compile`` (``Context.compile``) ``torch_compile=True``. A package a system needs that is not installed makes its
row n/a (``Unavailable``).

Each timed step is the Trainer's own loop from one ``on_step_end`` to the next (data loading,
scheduler and logging included), synchronised on the GPU; the first ``--warmup`` are dropped. The
engine is built inside ``train()`` (``create_optimizer``): ``info["engine_build_s"]`` is the time
from ``train()`` to the first step, so ``build_s`` counts only the model's construction (and
torchao's pinned host copies, made with its optimizer before the Trainer).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import tempfile
import time
from typing import Any

import torch
from transformers import Trainer as HFTrainer
from transformers import TrainerCallback, TrainingArguments

from elixir_hf import ElixirTrainer, ElixirTrainingArguments
from elixir_hf.commands.plan import DEVICE_LANE_WORDS
from elixir_runtime.plan_view import plan_table

from .gpu_marks import GpuMarks
from .harness import (
    LR,
    MAX_GRAD_NORM,
    STOCK_TRAINERS,
    WEIGHT_DECAY,
    Context,
    StockTrainer,
    Trainer,
    Unavailable,
    not_installed,
    packages,
    plan_summary,
)
from .models import Model, build_initialised_in_place, build_meta, materialize

__all__ = ["StepClock", "hf_trainer", "training_fields"]


class _Tokens(torch.utils.data.Dataset):
    """``n`` examples cycling over the rows of ``ids`` (labels = inputs)."""

    def __init__(self, ids: torch.Tensor, n: int) -> None:
        self.ids, self.n = ids.cpu(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "labels": row}


def hf_trainer(
    p: Model,
    ctx: Context,
    elixir: bool,
    anatomy: bool = False,
    stock: StockTrainer = STOCK_TRAINERS["trainer"],
    moments: str = "fp32",
) -> Trainer:
    """``ElixirTrainer`` (``elixir``: bf16 weights, the Trainer's AdamW over the engine's shards, its
    ``moments`` as ``ElixirConfig.moments``) or the
    stock ``Trainer`` over ``stock``'s weights and optimizer, built here and run on each timed call;
    ``anatomy``: each step's phases and the engine's update trace in ``info["anatomy"]``
    (``benchmarks.step_anatomy --system elixir_trainer``)."""
    info: dict[str, Any] = {"liger": ctx.liger, "compile": ctx.compile}
    for module, package in packages(None if elixir else stock, ctx.liger):
        _require(module, package, info)
    optimizers: tuple[torch.optim.Optimizer | None, None] = (None, None)
    if elixir:  # on meta on every rank, its init drawn on each rank's shards (elixir_hf.from_config's default)
        dtype = torch.bfloat16
        model = build_initialised_in_place(p, ctx.seq, dtype)
        info["optimizer"] = "Trainer default (AdamW) over Elixir shards" + (
            f", {moments} moments" if moments != "fp32" else ""
        )
    else:
        dtype = stock.weights
        # CPUOffloadOptimizer copies the parameters where they train, before the Trainer sees them
        model = materialize(build_meta(p, ctx.seq, dtype), ctx.device if stock.cpu_offload else "cpu", ctx.device)
        info["optimizer"] = f"optim={stock.optim}" if stock.optim else "Trainer default (AdamW)"
        if stock.cpu_offload:
            from torchao.optim import CPUOffloadOptimizer

            optimizers = (
                CPUOffloadOptimizer(
                    model.parameters(), torch.optim.AdamW, fused=True, lr=LR, weight_decay=WEIGHT_DECAY
                ),
                None,
            )
            info.update(
                optimizer="torchao CPUOffloadOptimizer(AdamW, fused=True)",
                lr_scheduler="the Trainer's (linear) over CPUOffloadOptimizer.param_groups (its inner AdamWs')",
            )
            if ctx.clip:
                info["clip_note"] = (
                    "backward's hooks copy each gradient to the host before the Trainer clips the GPU ones: "
                    "the CPU update is not clipped"
                )
    info["weights_dtype"] = str(dtype).removeprefix("torch.")

    def timed(ids: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], float]:
        clock = StepClock(ctx.device, anatomy)
        with tempfile.TemporaryDirectory(prefix=f"bench-{'elixir-' if elixir else ''}trainer-") as out_dir:
            fields = training_fields(ctx, out_dir, len(ids), warmup + steps, None if elixir else stock.optim)
            data = _Tokens(ids, len(ids) * ctx.world * (warmup + steps))
            if elixir:
                pinned = {"offload": ctx.offload} if ctx.offload is not None else {}  # --offload pins it
                if ctx.device_lane != "off":
                    pinned["device_assisted_update"] = DEVICE_LANE_WORDS[ctx.device_lane]
                if moments != "fp32":
                    pinned["moments"] = moments
                spec = json.dumps(pinned) if pinned else "auto"
                args = ElixirTrainingArguments(elixir=spec, **fields)
                trainer = ElixirTrainer(model=model, args=args, train_dataset=data, callbacks=[clock])
            else:
                args = TrainingArguments(**fields)
                trainer = HFTrainer(
                    model=model, args=args, train_dataset=data, callbacks=[clock], optimizers=optimizers
                )
            start = clock.now()
            out = trainer.train()
            info["engine_build_s"] = clock.first_begin - start
            logged = [e for e in trainer.state.log_history if "loss" in e]
            info["trainer_log"] = logged[-1] if logged else {}  # one entry: the loop's means (elixir/*: step phases)
            if anatomy:
                info["anatomy"] = {"stamps": clock.stamps, "trace": clock.trace, "marks": clock.marks}
            if elixir:
                plan, live = trainer.model._elixir.plan, trainer.model._elixir.live
                print(plan_table(plan), flush=True)
                # resident_chunks: those of parameters read outside their module (Liger's or TRL's fused head)
                info.update(plan=plan_summary(plan), plan_batch=len(ids), resident_chunks=len(live.root_chunks))
            return clock.times[warmup:], out.training_loss

    return Trainer(info=info, timed=timed)


def training_fields(
    ctx: Context, output_dir: str, batch: int, max_steps: int, optim: str | None = None
) -> dict[str, Any]:
    """The ``TrainingArguments`` of every Trainer-path system: the harness's AdamW hyper-parameters and
    clip, bf16 on the GPU, ``use_liger_kernel`` and ``torch_compile`` as ``ctx`` says, ``optim`` where given (else the
    Trainer's default); no saving, no reporting, one log entry."""
    fields: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=max_steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM if ctx.clip else 0.0,
        bf16=ctx.device.type == "cuda",
        use_cpu=ctx.device.type == "cpu",
        use_liger_kernel=ctx.liger,
        torch_compile=ctx.compile,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=max_steps,
    )
    if optim is not None:
        fields["optim"] = optim
    return fields


def _require(module: str, package: str, info: dict[str, Any]) -> None:
    """Imports ``module`` and records ``package``'s version in ``info``; ``Unavailable`` naming the fix if it is
    not installed (or does not import)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(not_installed(package, exc)) from exc
    info[package] = importlib.metadata.version(package)


class StepClock(TrainerCallback):
    """Times each optimizer step of the loop, end to end, synchronised on ``device``. With
    ``anatomy``, also each step's time stamps as ``benchmarks.step_anatomy`` takes them (start,
    loss: the model's forward returned, synced: after the clip, stepped, end) and the engine's
    update trace (``HostUpdates.trace``)."""

    def __init__(self, device: torch.device, anatomy: bool = False) -> None:
        self.device, self.times, self.anatomy = device, [], anatomy
        self.first_begin = self.last = 0.0
        self.stamps: list[dict[str, float]] = []
        self.trace: list | None = None
        self.runtime: Any = None
        """The engine's ``ChunkRuntime`` (set when training begins): the trace of its ``host_updates``,
        its counters at each step's end."""
        self.marks: GpuMarks | None = None
        """``gpu_marks.GpuMarks`` on those updates (set when training begins)."""
        self.hook: Any = None

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_train_begin(self, *a: Any, model: torch.nn.Module | None = None, **k: Any) -> None:
        if self.anatomy and model is not None:
            self.runtime = model._elixir.runtime
            self.runtime.host_updates.trace = self.trace = []
            self.marks = GpuMarks(self.runtime.host_updates, self.device)
            self.hook = model.register_forward_hook(lambda *_: self._loss())

    def on_train_end(self, *a: Any, **k: Any) -> None:
        if self.anatomy and self.trace is not None:
            self.runtime.host_updates.trace = None
            self.marks.close()
            self.hook.remove()

    def _loss(self) -> None:
        if self.marks is not None:
            self.marks.mark("loss")
        self._stamp("loss")

    def _stamp(self, key: str) -> None:
        if self.anatomy and self.stamps:
            self.stamps[-1][key] = time.perf_counter()

    def on_step_begin(self, *a: Any, **k: Any) -> None:
        if not self.first_begin:
            self.first_begin = self.last = self.now()
        if self.anatomy:
            self.stamps.append({"start": self.now()})
            if self.marks is not None:
                self.marks.mark("start")

    def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
        self._stamp("synced")

    def on_optimizer_step(self, *a: Any, **k: Any) -> None:
        self._stamp("stepped")

    def on_step_end(self, *a: Any, **k: Any) -> None:
        now = self.now()
        self.times.append(now - self.last)
        self.last = now
        self._stamp("end")
        if self.anatomy and self.stamps and self.runtime is not None:
            stats = self.runtime.stats
            self.stamps[-1].update(stalls=stats["update_stall_s"], gather_stalls=stats["gather_stall_s"])
