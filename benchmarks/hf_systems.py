"""The user's path as a system of the table: HF ``Trainer.train()`` with ``--elixir auto``, and the
stock Trainer beside it.

``elixir_trainer`` is what a user runs: ``ElixirTrainer`` + ``ElixirTrainingArguments(elixir="auto",
bf16=True)`` over a bf16 model, with the Trainer's defaults (AdamW, linear schedule, clip 1.0 unless
``--clip 0``, the lean loss ``ElixirTrainer`` installs). ``trainer`` is the stock ``Trainer`` with the
same arguments over an fp32 model (mixed precision by autocast, fp32 master weights: the numerics
Elixir keeps) and no Elixir: where it does not fit, its failure is the row.

Each timed step is the Trainer's own loop from one ``on_step_end`` to the next (data loading,
scheduler and logging included), synchronised on the GPU; the first ``--warmup`` are dropped. The
engine is built inside ``train()`` (``create_optimizer``): ``info["engine_build_s"]`` is the time
from ``train()`` to the first step, so ``build_s`` counts only the model's construction.
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import torch
from transformers import Trainer as HFTrainer
from transformers import TrainerCallback, TrainingArguments

from elixir_hf import ElixirTrainer, ElixirTrainingArguments

from .models import Model, build_initialised_in_place, build_meta, materialize
from .systems import LR, MAX_GRAD_NORM, WEIGHT_DECAY, Context, Trainer, plan_summary

__all__ = ["hf_trainer"]


class _Tokens(torch.utils.data.Dataset):
    """``n`` examples cycling over the rows of ``ids`` (labels = inputs)."""

    def __init__(self, ids: torch.Tensor, n: int) -> None:
        self.ids, self.n = ids.cpu(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "labels": row}


def hf_trainer(p: Model, ctx: Context, elixir: bool, anatomy: bool = False) -> Trainer:
    """``ElixirTrainer`` (``elixir``) or the stock ``Trainer``, built and run on each timed call;
    ``anatomy``: each step's phases and the engine's update trace in ``info["anatomy"]``
    (``benchmarks.step_anatomy --system elixir_trainer``)."""
    dtype = torch.bfloat16 if elixir else torch.float32
    if elixir:  # on meta on every rank, its init drawn on each rank's shards (elixir_hf.from_config's default)
        model = build_initialised_in_place(p, ctx.seq, dtype)
    else:
        model = materialize(build_meta(p, ctx.seq, dtype), "cpu", ctx.device)
    info: dict[str, Any] = {
        "optimizer": "Trainer default (AdamW)" + (" over Elixir shards" if elixir else ""),
        "weights_dtype": str(dtype).removeprefix("torch."),
    }

    def timed(ids: torch.Tensor, warmup: int, steps: int) -> tuple[list[float], float]:
        clock = _Clock(ctx.device, anatomy)
        fields = dict(
            output_dir=tempfile.mkdtemp(prefix=f"bench-{'elixir-' if elixir else ''}trainer-"),
            per_device_train_batch_size=len(ids),
            max_steps=warmup + steps,
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            max_grad_norm=MAX_GRAD_NORM if ctx.clip else 0.0,
            bf16=ctx.device.type == "cuda",
            use_cpu=ctx.device.type == "cpu",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            logging_steps=warmup + steps,
        )
        data = _Tokens(ids, len(ids) * ctx.world * (warmup + steps))
        if elixir:
            spec = "auto" if ctx.offload is None else json.dumps({"offload": ctx.offload})  # --offload pins it
            args = ElixirTrainingArguments(elixir=spec, **fields)
            trainer = ElixirTrainer(model=model, args=args, train_dataset=data, callbacks=[clock])
        else:
            trainer = HFTrainer(model=model, args=TrainingArguments(**fields), train_dataset=data, callbacks=[clock])
        start = clock.now()
        out = trainer.train()
        info["engine_build_s"] = clock.first_begin - start
        logged = [e for e in trainer.state.log_history if "loss" in e]
        info["trainer_log"] = logged[-1] if logged else {}  # one entry: the loop's means (elixir/*: step phases)
        if anatomy:
            info["anatomy"] = {"stamps": clock.stamps, "trace": clock.trace}
        if elixir:
            plan = trainer.model._elixir.plan
            print(plan.table(), flush=True)
            info.update(plan=plan_summary(plan), plan_batch=len(ids))
        return clock.times[warmup:], out.training_loss

    return Trainer(info=info, timed=timed)


class _Clock(TrainerCallback):
    """Times each optimizer step of the loop, end to end, synchronised on ``device``. With
    ``anatomy``, also each step's time stamps as ``benchmarks.step_anatomy`` takes them (start,
    loss: the model's forward returned, synced: after the clip, stepped, end) and the engine's
    update trace (``HostUpdates.trace``)."""

    def __init__(self, device: torch.device, anatomy: bool = False) -> None:
        self.device, self.times, self.anatomy = device, [], anatomy
        self.first_begin = self.last = 0.0
        self.stamps: list[dict[str, float]] = []
        self.trace: list | None = None
        self.updates: Any = None
        """The engine's ``HostUpdates`` whose trace this fills (set when training begins)."""
        self.hook: Any = None

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_train_begin(self, *a: Any, model: torch.nn.Module | None = None, **k: Any) -> None:
        if self.anatomy and model is not None:
            self.updates = model._elixir.runtime.host_updates
            self.updates.trace = self.trace = []
            self.hook = model.register_forward_hook(lambda *_: self._stamp("loss"))

    def on_train_end(self, *a: Any, **k: Any) -> None:
        if self.anatomy and self.trace is not None:
            self.updates.trace = None
            self.hook.remove()

    def _stamp(self, key: str) -> None:
        if self.anatomy and self.stamps:
            self.stamps[-1][key] = time.perf_counter()

    def on_step_begin(self, *a: Any, **k: Any) -> None:
        if not self.first_begin:
            self.first_begin = self.last = self.now()
        if self.anatomy:
            self.stamps.append({"start": self.now()})

    def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
        self._stamp("synced")

    def on_optimizer_step(self, *a: Any, **k: Any) -> None:
        self._stamp("stepped")

    def on_step_end(self, *a: Any, **k: Any) -> None:
        now = self.now()
        self.times.append(now - self.last)
        self.last = now
        self._stamp("end")
