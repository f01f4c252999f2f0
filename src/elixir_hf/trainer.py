"""``ElixirTrainer``: the HF ``Trainer`` with the Elixir engine underneath.

With ``ElixirTrainingArguments(elixir=None/"off")`` it *is* the stock Trainer, also under
``elixir-run`` (the arguments' "off" wins over the launch's ``ELIXIR_CONFIG``). Plain
``TrainingArguments`` (or a subclass such as TRL's ``SFTConfig``) are rebuilt as Elixir ones, so
``ELIXIR_CONFIG`` applies to them as to ``--elixir``. With Elixir on, it changes eight things, each
where the Trainer allows it:

* the accelerator is an ``ElixirAccelerator`` (``backward``/``clip_grad_norm_``/``no_sync``/
  skipped steps go to the engine; ``Accelerator(**args)`` is hard-coded in the Trainer, so the
  class is substituted for the duration of that one call: ``patches.trainer_accelerator``);
* ``create_optimizer`` builds the engine on ``self.model``: it runs after the resume weights were
  loaded into the plain model and before ``accelerator.prepare``, which then passes it through;
* ``save_model`` gathers the full weights with every rank taking part (a collective; the stock
  Trainer calls ``state_dict()`` on rank 0 only and would deadlock), keeps them on the writing
  process only (rank 0, or with ``save_on_each_node`` each node's main process: one host copy of the
  model per writer) and writes them atomically there, with ``elixir_plan.json`` beside them (the
  final output as well as every ``checkpoint-N``);
* optimizer state is saved by parameter name (``checkpoint/optimizer_files.py``: one safetensors file
  per rank and an index), plus the scheduler on rank 0; a checkpoint is complete once its marker
  (sizes and CRC-32s of all its files) is written, last, before older checkpoints are rotated out;
* resuming verifies the checkpoint (marker, sums, step; on every rank) and checks it against the
  model before loading, into whatever number of ranks and plan this run has; a plain PyTorch
  checkpoint (the stock Trainer's ``optimizer.pt``) loads too; ``resume_from_checkpoint=True``
  takes the newest complete checkpoint, warning about torn ones;
* a collective of ``train``, ``evaluate``, ``predict`` or ``save_model`` that fails because another
  rank gave up (``LockstepError``: the ranks diverged) raises that rank's error, not gloo's transport
  error (``elixir_runtime/distributed/peer_failure.py``), and one that waits for a rank that stopped
  answering ends the job naming it (``elixir_runtime/distributed/heartbeat.py``);
* SIGTERM or SIGUSR1 during ``train`` ends the run at a step's end, every rank alike, with a verified
  checkpoint when one fits the grace period, and exit status 75 (``preemption.py``);
* every training log carries the engine's ``elixir/*`` numbers (``log``, so they reach
  ``log_history`` and every reporter), and the console shows them as one short entry; each rank's
  go into ``OUTPUT_DIR/elixir_run``, and the end of training writes the run against its plan there
  (``callback.py``, ``elixir-plan --run``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, PredictionOutput, TrainOutput

from elixir_runtime import armed, attached_weights, park, rank0_state_dict, release

from . import patches
from .accelerator import ElixirAccelerator
from .arguments import as_elixir_args
from .batch_plan import planned_batch
from .callback import SHORT_CONSOLE, RunRecorder
from .checkpoint.convert import torch_adam_state
from .checkpoint.folder_lock import FolderLockError, hold
from .checkpoint.format import (
    PLAN_NAME,
    CheckpointError,
    Digest,
    all_ranks_agree,
    atomic_torch_save,
    check_resume,
    newest_complete,
    optimizer_format,
    seal,
    staged_dir,
    unmark,
    verify,
)
from .checkpoint.optimizer_files import load_optimizer, save_optimizer
from .console import follow_trainer
from .engine import build_engine, engine_state, has_engine
from .loading.stream import restream
from .metrics import once_only
from .mixin import mixed_class
from .plugin import ENV_VAR, ElixirPlugin, describe_model
from .preemption import Preemption

__all__ = ["ElixirTrainer", "elixir_trainer"]

SCHEDULER_NAME = "scheduler.pt"

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


class ElixirTrainer(Trainer):
    def __init__(self, model: Any = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        args = as_elixir_args(args)
        args._elixir_trainer = True  # the Trainer reads args.place_model_on_device, which checks this
        super().__init__(model, args, *rest, **kwargs)
        self._jit = bool(getattr(self.args, "enable_jit_checkpoint", False)) and self.elixir_plugin is not None
        self._preemption = Preemption(self, always_save=self._jit) if self.elixir_plugin is not None else None
        self._calls = 0
        """``train``/``evaluate``/``predict`` calls running (an evaluation inside training: 2)."""
        if self._preemption is not None:
            _drop_jit_checkpoint(self.callback_handler.callbacks)
            self.add_callback(self._preemption)
            follow_trainer(self.args)
            callbacks = self.callback_handler.callbacks
            for i, callback in enumerate(callbacks):
                if type(callback) in SHORT_CONSOLE:  # the Trainer built it with no arguments
                    callbacks[i] = SHORT_CONSOLE[type(callback)]()
            callbacks.insert(0, RunRecorder(callbacks, self.accelerator.elixir_metrics))  # ends before the reporters

    @property
    def elixir_plugin(self) -> ElixirPlugin | None:
        return getattr(self.args, "elixir_plugin", None)

    @property
    def _output_dir(self) -> str:
        """``args.output_dir``: Optional among the arguments' fields, set by their ``__post_init__``."""
        assert self.args.output_dir is not None, "TrainingArguments.__post_init__ sets output_dir"
        return self.args.output_dir

    # ------------------------------------------------------------------ engine
    def create_accelerator_and_postprocess(self) -> None:
        if self.elixir_plugin is None:
            # off in these arguments is off for their Accelerator too: under elixir-run it is an Elixir
            # one, which would read ELIXIR_CONFIG and put the engine under a Trainer that runs stock
            with mock.patch.dict(os.environ, {ENV_VAR: "off"}):
                return super().create_accelerator_and_postprocess()

        def accelerator(**kwargs: object) -> ElixirAccelerator:
            return ElixirAccelerator(elixir_plugin=self.elixir_plugin, **kwargs)

        with patches.trainer_accelerator(accelerator):
            super().create_accelerator_and_postprocess()

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The stock AdamW (HF's decay groups and hyperparameters), then the engine built from it."""
        target = model if model is not None else self.model
        assert target is not None, "the Trainer holds its model (given, or built by model_init)"
        if self.elixir_plugin is None or self._owns_engine(target):
            return super().create_optimizer(model)
        self.optimizer = None  # an optimizer of an engine released since (another Trainer took the model)
        if has_engine(target):
            logger.info(
                "elixir: the model runs on another Trainer's engine: it is released, and one built for this one"
            )
            release(
                target
            )  # its weights back in the model (host memory), its memory freed: [Note: a model trained again]
        optimizer = super().create_optimizer(model)
        batch = (
            planned_batch(self.train_dataset, self.data_collator, self._train_batch_size, args=self.args, model=target)
            if self.train_dataset is not None
            else None
        )
        self.optimizer = build_engine(
            target,
            optimizer,
            self.elixir_plugin,
            self.args.device,
            batch,
            args=self.args,
            grad_accum_steps=self.args.gradient_accumulation_steps,
            compile_kwargs=self.accelerator.elixir_compile,
        )
        return self.optimizer

    def _owns_engine(self, model: torch.nn.Module) -> bool:
        """Whether this Trainer's optimizer is the one of the engine ``model`` runs on.

        [Note: a model trained again]
        The stock Trainer accepts a model another Trainer trained (continuing with other arguments, an
        auto-batch-size retry, a resume in the same process) and builds a new AdamW for it. Here the model
        carries that Trainer's engine, planned for its batch and arguments: ``create_optimizer`` releases
        it (``elixir_runtime.release``: the trained weights back in the model's own parameters, the
        engine's memory freed) and builds one for this Trainer's, from a fresh AdamW as the stock Trainer
        does. The same Trainer training again keeps its engine and its Adam state, as the stock Trainer
        keeps its optimizer; a Trainer whose engine another one released builds a new one.
        """
        if self.optimizer is None or not has_engine(model):
            return False
        return getattr(self.optimizer, "elixir_optimizer", self.optimizer) is engine_state(model).optimizer

    def _ensure_engine(self) -> None:
        """Evaluation before training must run on the engine too (the model never went to the GPU)."""
        if self.elixir_plugin is not None and not has_engine(self.model):
            self.create_optimizer()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._ensure_engine()
        with self._explained("evaluate"), self._readable_after():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> PredictionOutput:
        self._ensure_engine()
        with self._explained("predict"), self._readable_after():
            return super().predict(*args, **kwargs)

    @contextlib.contextmanager
    def _readable_after(self) -> Iterator[None]:
        """When the outermost ``train``/``evaluate``/``predict`` returns, ``model.parameters()`` read the
        trained values, as the stock Trainer's do (``elixir_runtime.park``; the engine takes them back
        at the next forward). Not after an evaluation inside training, nor when the call raised."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
        if self._calls == 0 and self.model is not None and has_engine(self.model):
            parked = park(self.model)
            logger.info(
                "elixir: model.parameters() read the trained weights (%s) until the next step", _WHERE[parked.where]
            )

    @contextlib.contextmanager
    def _explained(self, where: str) -> Iterator[None]:
        """A collective inside (the Trainer's gathers included) that fails because another rank gave
        up raises that rank's ``LockstepError``, not gloo's transport error ([Note: the rank that ran
        ahead], ``elixir_runtime/distributed/peer_failure.py``); a rank that stops answering meanwhile ends
        the job, named (``elixir_runtime/distributed/heartbeat.py``)."""
        try:
            with armed():
                yield
        except RuntimeError as exc:
            model = self.model
            board = engine_state(model).runtime.lockstep.board if model is not None and has_engine(model) else None
            if board is not None:
                board.raise_posted(exc, f"a collective in Trainer.{where}")
            raise

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """A training log (it has ``loss``) gets this rank's engine numbers before the Trainer
        records it in ``log_history`` and hands it to every callback and reporter."""
        if "loss" in logs and has_engine(self.model) and isinstance(self.accelerator, ElixirAccelerator):
            metrics = self.accelerator.elixir_metrics()
            if any(once_only(h) for h in self.state.log_history):  # a resumed run: its checkpoint's history has them
                metrics = {k: v for k, v in metrics.items() if k not in once_only(metrics)}
            logs.update(metrics)
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        try:
            with self._explained("train"), self._one_job_per_folder(), self._readable_after():
                if self.elixir_plugin is not None and resume_from_checkpoint is True:
                    resume_from_checkpoint = newest_complete(self._output_dir)
                output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._preemption is not None:
                self._preemption.release()  # on_train_end's, when train() raised before it
        if self._preemption is not None and not self._jit:  # --enable_jit_checkpoint: train() returns, as stock
            self._preemption.exit_if_preempted()  # SIGTERM/SIGUSR1: after the lock is released (preemption.py)
        return output

    @contextlib.contextmanager
    def _one_job_per_folder(self) -> Iterator[None]:
        """``output_dir``'s lock (``checkpoint/folder_lock.py``), taken by the saving process and held for as long as
        this trainer lives (its final ``save_model`` included); every rank fails, naming the folder and the job
        holding it, if another live job does (or naming the error, if it cannot be taken)."""
        if self.elixir_plugin is None:  # --elixir off: the stock Trainer's run
            yield
            return
        error = None
        if self.args.should_save:
            try:
                hold(self._output_dir, self)
            except (FolderLockError, OSError) as e:
                error = str(e)
        all_ranks_agree(error, f"taking output_dir {self.args.output_dir}")
        yield

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The stock save, then the marker, then the rotation of older checkpoints (deferred: until
        the new one is complete, the older ones are what a resume falls back to)."""
        if not has_engine(self.model):
            return super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            unmark(folder)
        self._digests: dict[str, Digest] = {}
        error = None
        with patches.deferred_rotation() as rotate:
            try:
                super()._save_checkpoint(model, trial)
            except OSError as e:  # the Trainer's own writes (trainer_state.json, RNG states), after its collectives
                error = str(e)
        all_ranks_agree(error, f"saving checkpoint {folder}")  # on every rank, named: not gloo's closed connection
        seal(
            folder,
            self._digests,
            step=self.state.global_step,
            optimizer=not self.args.save_only_model,
            is_main=self.args.should_save,
        )
        rotate()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not has_engine(self.model):
            return super().save_model(output_dir, _internal_call)
        with self._explained("save_model"):
            self._save_model(output_dir, _internal_call)

    def _save_model(self, output_dir: str | None, _internal_call: bool) -> None:
        output_dir = output_dir if output_dir is not None else self._output_dir
        model = self.model
        assert model is not None, "save_model saves the Trainer's model"
        # collective: every rank takes part; only the writers keep the weights (rank 0, or with
        # save_on_each_node the main process of each node, whose disk holds a folder of its own)
        with rank0_state_dict(model, keep=self.args.should_save):
            state_dict = model.state_dict()
        error = None
        if self.args.should_save:
            try:
                with (
                    staged_dir(output_dir) as stage,
                    patches.save_messages_name(stage, output_dir),
                    patches.save_pretrained_where_told(model),
                ):
                    self._save(stage, state_dict=state_dict)
                    plan = {**json.loads(engine_state(model).plan.to_json()), "model": describe_model(model)}
                    Path(stage, PLAN_NAME).write_text(json.dumps(plan, indent=2))
            except OSError as e:
                error = str(e)
        # a collective: a failed write is raised on every rank, and no rank runs ahead into its next
        # forward (a lockstep check-in, ElixirConfig.lockstep_timeout_s) while rank 0 still writes
        all_ranks_agree(error, f"saving the model to {output_dir}")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not has_engine(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        args, scheduler = self.args, self.lr_scheduler
        assert scheduler is not None, "train() builds the scheduler before it saves"
        self._digests.update(
            save_optimizer(
                output_dir,
                self.optimizer,
                rank=args.process_index,
                world_size=args.world_size,
                is_main=args.should_save,
                global_step=self.state.global_step,
            )
        )
        error = None
        if args.should_save:
            try:
                self._digests[SCHEDULER_NAME] = atomic_torch_save(
                    scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME)
                )
            except OSError as e:
                error = str(e)
        all_ranks_agree(error, f"saving checkpoint {output_dir}")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        target = model if model is not None else self.model
        assert target is not None, "the Trainer holds its model (given, or built by model_init)"
        if self.elixir_plugin is not None:
            if not os.path.isdir(resume_from_checkpoint):  # the stock Trainer's words for a mistyped path
                raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
            self._resume_marker = check_resume(
                resume_from_checkpoint, target, self.args.world_size, self.args.process_index, self.args.should_save
            )
            if not has_engine(target) and attached_weights(target) is not None:
                # streamed (elixir_hf.from_pretrained): the engine reads the checkpoint's weights instead
                error = None
                try:
                    restream(target, resume_from_checkpoint)
                except Exception as e:  # noqa: BLE001 - every rank raises it
                    error = f"{type(e).__name__}: {e}"
                all_ranks_agree(error, f"streaming the weights of {resume_from_checkpoint}")
                return
            if not has_engine(target) and all(p.is_meta for p in target.parameters()):
                # a rank that built the model on meta (elixir_hf.from_pretrained): rank 0 loads the
                # checkpoint's weights and the engine gives them to this rank; reading the file here
                # too would hold one more full copy of the model in host memory
                return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.elixir_plugin is None and optimizer_format(checkpoint) == "named":
            return self._load_elixir_state_stock(checkpoint)
        if checkpoint is None or not has_engine(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if getattr(self, "_resume_marker", False) is False:
            self._resume_marker = verify(checkpoint, self.args.process_index, self.args.should_save)
        marker = self._resume_marker  # None: a plain PyTorch checkpoint
        if marker is not None and not marker["optimizer"]:
            return  # weights only (save_only_model): fresh optimizer and scheduler, as the stock Trainer does
        plugin, scheduler = self.elixir_plugin, self.lr_scheduler
        assert plugin is not None, "the engine is built under an Elixir plugin only"
        assert scheduler is not None, "train() builds the scheduler before it resumes"
        error = None
        try:
            load_optimizer(
                checkpoint,
                self.optimizer,
                marker["step"] if marker is not None else None,
                allow_missing=plugin.allow_missing_adam_state,
            )
            scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        except Exception as e:  # noqa: BLE001 - every rank raises it
            error = f"{type(e).__name__}: {e}"
        all_ranks_agree(error, f"loading the optimizer state of {checkpoint}")

    def _load_elixir_state_stock(self, checkpoint: str) -> None:
        """``--elixir off`` resuming an Elixir checkpoint: the stock Trainer finds no ``optimizer.pt`` and
        would restart AdamW and the schedule in silence. Instead the fp32 master weights go into the
        model, the Adam state by parameter name into the stock optimizer (what ``elixir-convert``
        writes), and the schedule into the scheduler, so the run continues as the Elixir run would.
        A trainable parameter the checkpoint holds no state for is refused, naming it."""
        model, optimizer, scheduler = self.model, self.optimizer, self.lr_scheduler
        assert model is not None and optimizer is not None and scheduler is not None, "train() builds them first"
        error = None
        try:
            verify(checkpoint, self.args.process_index, self.args.should_save)
            mine = [p for g in optimizer.param_groups for p in g["params"]]
            position = {id(p): i for i, p in enumerate(mine)}

            def numbering(params: list[torch.nn.Parameter]) -> list[int]:
                return [position[id(p)] for p in params if id(p) in position]

            state, groups = torch_adam_state(Path(checkpoint), model, numbering)
            covered = {i for g in groups for i in g["params"]}
            names = {id(p): n for n, p in model.named_parameters()}
            missing = [names.get(id(p), "?") for i, p in enumerate(mine) if i not in covered and p.requires_grad]
            if missing:
                raise CheckpointError(
                    f"{checkpoint} holds no Adam state for {missing}: resume with the model it was saved from"
                )
            sd = optimizer.state_dict()
            group_of = {i: g for g in groups for i in g["params"]}
            for g in sd["param_groups"]:
                saved = group_of[g["params"][0]] if g["params"] else {}
                g.update({k: v for k, v in saved.items() if k in ("lr", "initial_lr")})
            sd["state"] = state
            optimizer.load_state_dict(sd)
            scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        except Exception as e:  # noqa: BLE001 - every rank raises it
            error = f"{type(e).__name__}: {e}"
        all_ranks_agree(error, f"loading the Elixir optimizer state of {checkpoint} into the stock optimizer")
        logger.info("elixir: --elixir off resumes %s with its Adam state, schedule and fp32 weights", checkpoint)


_WHERE = {
    "shards": "views of the engine's shards: no copy",
    "device": "a copy on the GPU",
    "host": "a copy in host memory",
    None: "no: neither the GPU nor the host has room for a copy; read them with model.state_dict()",
}
"""``elixir_runtime.Parked.where`` in words."""


def _drop_jit_checkpoint(callbacks: list[Any]) -> None:
    """``--enable_jit_checkpoint``: transformers' callback out, its SIGTERM handler undone. It saves on the
    rank the signal reaches, alone, and an Elixir save is a collective of every rank; the engine's
    preemption save (``preemption.py``, every rank agreeing) saves instead, whatever the grace."""
    for callback in [c for c in callbacks if type(c).__name__ == "JITCheckpointCallback"]:
        manager = callback.jit_manager
        if manager is not None and manager._original_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
        callbacks.remove(callback)


@functools.cache
def elixir_trainer(cls: type[Trainer]) -> type[ElixirTrainer]:
    """``cls`` (a ``Trainer`` subclass, e.g. TRL's ``SFTTrainer``) on the Elixir engine: ``cls`` first
    in the MRO, its overrides calling ``ElixirTrainer``'s through ``super()``.

        trainer = elixir_hf.elixir_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds)
    """
    namespace = {}
    if hasattr(cls, "_precompute_ref_logps"):  # TRL's DPOTrainer (precompute_ref_log_probs)
        namespace["_precompute_ref_logps"] = _engine_first(cls._precompute_ref_logps)
    return mixed_class(cls, ElixirTrainer, namespace)


def _engine_first(precompute: Callable[..., _R]) -> Callable[..., _R]:
    """TRL's ``_precompute_ref_logps`` runs the trained model as the reference (no ``ref_model``: its
    starting weights) inside ``__init__`` and ``evaluate``, before ``train()`` builds the engine: build it
    first, as evaluation before training does (``_ensure_engine``), so the forward runs on the engine."""

    @functools.wraps(precompute)
    def run(self: ElixirTrainer, *args: object, **kwargs: object) -> _R:
        if getattr(self, "ref_model", None) is None:
            self._ensure_engine()
        return precompute(self, *args, **kwargs)

    return run
