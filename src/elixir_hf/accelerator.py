"""``ElixirAccelerator``: an ``Accelerator`` whose ``prepare`` installs the Elixir engine.

For a plain Accelerate script the change is one line::

    accelerator = ElixirAccelerator()            # was Accelerator(); settings from ELIXIR_CONFIG or auto
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.backward(loss); accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); scheduler.step(); optimizer.zero_grad()

What changes underneath: the model is never moved, DDP-wrapped, autocast or compiled (the engine
places, shards and reduces it, and owns the compute dtype: accelerate's ``mixed_precision``
becomes the engine's dtype and Accelerate itself runs with ``"no"``); ``backward`` scales the loss
for fp16 and reduces gradients into shards; ``clip_grad_norm_`` returns the engine's global norm
and folds clipping into the next step; checkpoints keep the optimizer state by parameter name,
one file per rank, loadable into any number of ranks and plan (``checkpoint/optimizer_files.py``);
``accelerator.log`` carries the engine's ``elixir/*`` numbers (``elixir_metrics``) to the trackers;
the loop's own collectives between the engine's steps (``gather``, ``gather_for_metrics``, ``reduce``,
``pad_across_processes``, ``wait_for_everyone``) are under the lockstep timeout ([Note: collectives
between the steps]).

[Note: collectives between the steps]
The engine needs the other ranks from a step's first check-in to its ``zero_grad``
(``elixir_runtime/distributed/heartbeat.py``); a loop that then calls ``accelerator.gather(loss)``
waits in a collective of its own, where a rank stopped between the steps left it until the
process group's timeout (30 minutes). So each of these methods arms the heartbeat: a rank silent for
``lockstep_timeout_s`` ends every rank naming it (exit status 69), and a collective failed because
another rank gave up raises that rank's error. Not covered: collectives the loop calls outside the
Accelerator's methods (``torch.distributed.*``, ``accelerate.utils.broadcast``, ``gather_object``,
``PartialState.wait_for_everyone`` and ``main_process_first``): they wait until ``--ddp_timeout`` /
``InitProcessGroupKwargs(timeout=...)``; wrap them in ``elixir_runtime.armed()`` to cover them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar, cast

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import SAFE_WEIGHTS_NAME, DynamoBackend
from torch import nn

from elixir_runtime import ElixirOptimizer, armed, check_compile_options, load_safetensors, rank0_state_dict

from . import patches
from .batch_plan import planned_batch
from .checkpoint.format import all_ranks_agree, optimizer_format, seal, unmark, verify
from .checkpoint.optimizer_files import load_optimizer, save_optimizer
from .console import follow_accelerator
from .engine import build_engine, engine_state, has_engine, whole_model
from .launch import check_devices, check_launch
from .metrics import EngineMetrics
from .mixin import mixed_class
from .optimizer import ElixirAcceleratedOptimizer
from .plugin import ENV_VAR, ElixirPlugin, ElixirSpecError, check_exclusive
from .reference import frozen_engine

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

__all__ = ["ElixirAccelerator", "elixir_accelerator"]


class ElixirAccelerator(Accelerator):  # type: ignore[misc]  # accelerate ships no types: Accelerator is Any
    def __init__(
        self, *args: object, elixir_plugin: ElixirPlugin | str | dict[str, object] | None = None, **kwargs: object
    ) -> None:
        """``elixir_plugin``: an ``ElixirPlugin`` or a spec (``auto``, ``off``, JSON, file); ``None``
        reads ``ELIXIR_CONFIG`` and falls back to ``auto``."""
        if elixir_plugin is None:
            plugin = ElixirPlugin.from_spec(os.environ.get(ENV_VAR, "auto"), ENV_VAR)
        else:
            plugin = ElixirPlugin.from_spec(elixir_plugin, "ElixirAccelerator(elixir_plugin=...)")
        if plugin is not None:
            plugin = dataclasses.replace(plugin)  # resolving the dtype must not change the caller's object
            check_exclusive(
                {
                    "DeepSpeed": any(kwargs.get(k) is not None for k in ("deepspeed_plugin", "deepspeed_plugins")),
                    "FSDP": kwargs.get("fsdp_plugin") is not None,
                    "Megatron-LM": kwargs.get("megatron_lm_plugin") is not None,
                }
            )
            mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            plugin.resolve_dtype(str(mixed))
            kwargs["mixed_precision"] = "no"
            if not PartialState._shared_state:  # the Trainer's arguments picked the devices (and checked them) already
                check_devices("Accelerator", cpu=bool(kwargs.get("cpu")))  # before Accelerate picks devices
        super().__init__(*args, **kwargs)
        self.elixir_plugin = plugin
        self._engine_metrics: EngineMetrics | None = None
        self.elixir_compile: dict[str, Any] | None = None
        """``torch.compile`` arguments (``--torch_compile``, a dynamo config) the engine applies to each block
        (``elixir_runtime.compile_blocks``) instead of Accelerate compiling the whole model through its hooks."""
        if plugin is not None:
            dynamo = self.state.dynamo_plugin
            if dynamo.backend != DynamoBackend.NO:
                self.elixir_compile = dynamo.to_kwargs()
                try:
                    check_compile_options(**self.elixir_compile)
                except ValueError as exc:
                    raise ElixirSpecError(
                        f"{exc} (--torch_compile_mode / the accelerate config's dynamo_config)"
                    ) from None
                if dynamo.use_regional_compilation:
                    logger.info(
                        "elixir: dynamo's use_regional_compilation is what the engine does: each block compiled"
                    )
                dynamo.backend = DynamoBackend.NO
            plugin.check_world_size(self.num_processes)
            check_launch(self.num_processes, "Accelerator")
            follow_accelerator(self.is_main_process)

    @property
    def elixir_optimizer(self) -> ElixirAcceleratedOptimizer | None:
        """The ``ElixirAcceleratedOptimizer`` ``prepare`` built (it wraps the ``ElixirOptimizer``), if any."""
        return next((o for o in self._optimizers if isinstance(o, ElixirAcceleratedOptimizer)), None)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.elixir_plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        objs = list(args)
        models = [i for i, o in enumerate(objs) if isinstance(o, nn.Module)]
        optimizers = [i for i, o in enumerate(objs) if isinstance(o, torch.optim.Optimizer)]
        if len(models) > 1 or len(optimizers) > 1:
            raise ValueError("ElixirAccelerator trains one model with one optimizer; prepare the others separately")
        if models and optimizers:
            model, optimizer = objs[models[0]], objs[optimizers[0]]
            if not isinstance(optimizer, (ElixirOptimizer, ElixirAcceleratedOptimizer)):
                loader = next((o for o in objs if isinstance(o, torch.utils.data.DataLoader)), None)
                batch = (
                    planned_batch(loader.dataset, loader.collate_fn, loader.batch_size or 1, model=model)
                    if loader
                    else None
                )
                objs[optimizers[0]] = build_engine(
                    model,
                    optimizer,
                    self.elixir_plugin,
                    self.device,
                    batch,
                    grad_accum_steps=self.gradient_accumulation_steps,
                    compile_kwargs=self.elixir_compile,
                )
                patches.mark_optimizer_stepped(optimizer)
        prepared = super().prepare(*objs, device_placement=device_placement)
        if models and optimizers:
            wrapped = self.elixir_optimizer
            assert wrapped is not None, "prepare_optimizer wrapped the engine's optimizer"
            self._engine_metrics = EngineMetrics(
                wrapped, engine_state(objs[models[0]]).plan, compiled=self.elixir_compile is not None
            )
        return prepared

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """A model the engine runs passes through; one only evaluated (``evaluation_mode``: TRL's reference
        model) gets an engine of frozen chunks (``reference.frozen_engine``)."""
        prepared: nn.Module
        if self.elixir_plugin is None:
            prepared = super().prepare_model(model, device_placement, evaluation_mode)
            return prepared
        if not has_engine(model):
            if not evaluation_mode:
                raise ValueError(
                    "ElixirAccelerator needs the model and its optimizer (torch.optim.AdamW or Adam) in the same "
                    "prepare() call: Elixir shards the optimizer states together with the parameters; a model only "
                    "evaluated (a frozen reference) takes prepare_model(model, evaluation_mode=True)"
                )
            frozen_engine(model, self.elixir_plugin, self.device)  # TRL's reference model (reference.py)
        patches.mark_accelerate_prepared(model)  # the engine places and reduces it: no .to(), DDP, autocast
        prepared = super().prepare_model(model, device_placement, evaluation_mode)
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> torch.optim.Optimizer:
        if self.elixir_plugin is None or getattr(optimizer, "_is_accelerate_prepared", False):
            prepared: torch.optim.Optimizer = super().prepare_optimizer(optimizer, device_placement)
            return prepared
        if not isinstance(optimizer, ElixirOptimizer):
            raise ValueError(
                "ElixirAccelerator prepares an optimizer only together with its model, in one prepare() call"
            )
        wrapped = ElixirAcceleratedOptimizer(optimizer)
        patches.register_optimizer(self, wrapped)  # optimizer_step_was_skipped, save_state read it
        return wrapped

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: object) -> None:
        opt = self.elixir_optimizer
        if opt is None:
            super().backward(loss, **kwargs)
            return
        with opt.timer("backward"):
            opt.elixir_optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """The engine's global grad norm (all chunks, all ranks); clipping is fused into ``step``."""
        opt = self.elixir_optimizer
        if opt is None:
            return cast(torch.Tensor, super().clip_grad_norm_(parameters, max_norm, norm_type))
        if math.isinf(max_norm):
            return torch.tensor(opt.elixir_optimizer.grad_norm())
        return opt.elixir_optimizer.clip_grad_norm(max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        opt = self.elixir_optimizer
        return super().no_sync(model) if opt is None else opt.elixir_optimizer.no_sync()

    # ------------------------------------------------------------------ collectives between the steps
    # Each returns what it is given, in the same structure (a tensor, or nested lists, tuples, dicts of them).
    def gather(self, tensor: _T) -> _T:
        with self._collective("gather"):
            gathered: _T = super().gather(tensor)
        return gathered

    def gather_for_metrics(self, input_data: _T, use_gather_object: bool = False) -> _T:
        with self._collective("gather_for_metrics"):
            gathered: _T = super().gather_for_metrics(input_data, use_gather_object)
        return gathered

    def reduce(self, tensor: _T, reduction: str = "sum", scale: float = 1.0) -> _T:
        with self._collective("reduce"):
            reduced: _T = super().reduce(tensor, reduction, scale)
        return reduced

    def pad_across_processes(self, tensor: _T, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> _T:
        with self._collective("pad_across_processes"):
            padded: _T = super().pad_across_processes(tensor, dim, pad_index, pad_first)
        return padded

    def wait_for_everyone(self) -> None:
        with self._collective("wait_for_everyone"):
            super().wait_for_everyone()

    @contextlib.contextmanager
    def _collective(self, name: str) -> Iterator[None]:
        """A collective of the loop's, under the lockstep timeout ([Note: collectives between the steps])."""
        model = next((m for m in self._models if has_engine(m)), None)
        if model is None:
            yield
            return
        try:
            with armed():
                yield
        except RuntimeError as exc:
            board = engine_state(model).runtime.lockstep.board
            if board is not None:
                board.raise_posted(exc, f"accelerator.{name}")
            raise

    # ------------------------------------------------------------------ metrics
    def elixir_metrics(self) -> dict[str, float]:
        """The engine's ``elixir/*`` numbers since the previous call, this rank's (``{}`` before
        ``prepare`` or with Elixir off); see ``EngineMetrics``."""
        return self._engine_metrics.collect() if self._engine_metrics is not None else {}

    def log(
        self, values: dict[str, object], step: int | None = None, log_kwargs: dict[str, object] | None = None
    ) -> None:
        """Accelerate's ``log`` (to every tracker, on the main process), with ``elixir_metrics()``
        merged into ``values``."""
        super().log({**self.elixir_metrics(), **values}, step=step, log_kwargs=log_kwargs)

    # ------------------------------------------------------------------ forwards on some ranks
    def full_params(self, model: nn.Module, rank0_only: bool = False) -> contextlib.AbstractContextManager[nn.Module]:
        """Enter on every rank; inside, forwards run on any rank alone, e.g. on the main process::

            with accelerator.full_params(model):
                if accelerator.is_main_process:
                    accelerator.unwrap_model(model).generate(**prompt)

        ``unwrap_model`` itself returns the model unchanged, as Accelerate does for a model it did
        not wrap: the Trainer relies on ``unwrap_model(model) is model`` and calls it on rank 0
        alone (when saving), so it can neither gather (a collective) nor return a copy. Outside
        this context a forward on some ranks only fails on every rank within 60 s, naming it.
        Without the engine (``--elixir off``) the context does nothing."""
        return whole_model(model, rank0_only)

    # ------------------------------------------------------------------ checkpoints
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The consolidated weights on the main process; the other ranks get no parameters, as with
        FSDP (one host copy of the model). A collective: call it on every rank. ``save_state`` and
        ``save_model`` go through here."""
        if not has_engine(model):
            state: dict[str, torch.Tensor] = super().get_state_dict(model, unwrap)
            return state
        with rank0_state_dict(model):
            return model.state_dict()

    @armed()  # a rank that stops answering meanwhile is named (elixir_runtime/distributed/heartbeat.py)
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: object) -> str:
        """Accelerate's state plus the optimizer state by parameter name, each rank writing its part
        (Accelerate would save rank 0's only), then the marker (sizes and CRC-32s of every file),
        written last."""
        opt = self.elixir_optimizer
        if opt is None:
            return cast(str, super().save_state(output_dir, safe_serialization, **kwargs))
        if output_dir is not None and self.is_main_process:
            unmark(output_dir)  # saving again into a folder: torn until the new marker
        with patches.hidden_from_accelerate(self, opt):
            location: str = super().save_state(output_dir, safe_serialization, **kwargs)
        digests = save_optimizer(
            location,
            opt,
            rank=self.process_index,
            world_size=self.num_processes,
            is_main=self.is_main_process,
            global_step=None,
        )
        seal(location, digests, step=None, optimizer=True, is_main=self.is_main_process)
        return location

    @armed()
    def load_state(self, input_dir: str | None = None, **kwargs: object) -> None:
        """Accelerate's state, the weights through the engine's own ``load_state_dict`` (any layout,
        tied weights stored once) and the optimizer state, saved by any number of ranks and plan; a
        plain Accelerate folder's ``optimizer.bin`` loads too (moments mapped by optimizer order)."""
        opt = self.elixir_optimizer
        if opt is None:
            super().load_state(input_dir, **kwargs)
            return
        if input_dir is None:
            raise ValueError("ElixirAccelerator.load_state needs the checkpoint folder (input_dir)")
        if not os.path.isdir(input_dir):  # not "incomplete" (verify's word for a folder without its marker)
            raise FileNotFoundError(
                f"ElixirAccelerator.load_state: {input_dir} does not exist (or is not a folder): pass the folder "
                "that save_state wrote"
            )
        fmt = optimizer_format(input_dir)
        if fmt != "plain":
            verify(input_dir, self.process_index, self.is_main_process)  # fails on every rank
        model = next(m for m in self._models if has_engine(m))
        with patches.hidden_from_accelerate(self, opt, model):
            super().load_state(input_dir, **kwargs)
        load_safetensors(model, os.path.join(input_dir, SAFE_WEIGHTS_NAME))  # a tensor at a time, not the file per rank
        plugin = self.elixir_plugin
        assert plugin is not None, "the engine is built under an Elixir plugin only"
        error = None
        try:
            load_optimizer(input_dir, opt, allow_missing=plugin.allow_missing_adam_state)
        except Exception as e:  # noqa: BLE001 - every rank raises it
            error = f"{type(e).__name__}: {e}"
        all_ranks_agree(error, f"loading the optimizer state of {input_dir}")


@functools.cache
def elixir_accelerator(cls: type[Accelerator]) -> type[ElixirAccelerator]:
    """``cls`` (an ``Accelerator`` subclass) with ``ElixirAccelerator`` after it in the MRO."""
    return mixed_class(cls, ElixirAccelerator)
