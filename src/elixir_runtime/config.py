"""User-facing configuration of the engine: what to run, not how it is laid out.

``ElixirConfig()`` means: automatic plan, compute in the model's own dtype. Every field of a
*static* plan can be forced here so that tests (and users who know better) get any shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Literal, TypeGuard, cast

import torch
import torch.distributed as dist

from .adam_state import MOMENTS, AdamState, Moments, adam_state

__all__ = [
    "ConfigError",
    "ElixirConfig",
    "LossScaleConfig",
    "PlanError",
    "PlanMismatch",
    "Where",
    "parse_size",
    "MIN_SIZE",
    "resolve_dtype",
]

BlockCount = int | Literal["min", "max"]

Where = Literal["device", "host"]
"""A memory tier: the compute device, or pinned host memory. What a plan places in one: each chunk's shard
and optimizer state (``ElixirPlan.offload``), the held block inputs (``ElixirPlan.activations``)."""


class PlanError(ValueError):
    """The requested plan cannot run; the message names the numbers and the fix."""


class PlanMismatch(PlanError):
    """A plan given to follow (a plan file) describes another layout than this model gives;
    raised before anything is allocated."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field, the value and what to use.

    Raised while the config is built, before anything runs (``elixir_hf`` adds where the value
    came from: ``--elixir``, ``ELIXIR_CONFIG`` or a file)."""


def _int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _indices(v: object) -> TypeGuard[Sequence[int]]:
    return isinstance(v, (list, tuple)) and all(_int(i) and i >= 0 for i in v)


def _check(config: object, rules: dict[str, tuple[bool, str]]) -> None:
    """``rules``: field name -> (whether its value is valid, what a valid value is)."""
    for name, (ok, need) in rules.items():
        if not ok:
            value = getattr(config, name)
            raise ConfigError(f"{type(config).__name__}.{name} must be {need}, got {value!r} ({type(value).__name__})")


@dataclass(kw_only=True, frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, used only when the compute dtype is float16 (defaults as torch's GradScaler)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        _check(
            self,
            {
                "init_scale": (
                    _real(self.init_scale) and self.init_scale > 0,
                    "a positive finite number such as 65536.0",
                ),
                "growth_factor": (
                    _real(self.growth_factor) and self.growth_factor > 1,
                    "a finite number > 1 such as 2.0",
                ),
                "backoff_factor": (
                    _real(self.backoff_factor) and 0 < self.backoff_factor < 1,
                    "a number in (0, 1) such as 0.5",
                ),
                "growth_interval": (
                    _int(self.growth_interval) and self.growth_interval >= 1,
                    "an int >= 1 (steps) such as 2000",
                ),
                "min_scale": (
                    _real(self.min_scale)
                    and 0 < self.min_scale <= (self.init_scale if _real(self.init_scale) else math.inf),
                    "a positive finite number no larger than init_scale, such as 1.0",
                ),
            },
        )


_RUN = {"run": True}
"""Marks an ``ElixirConfig`` field the run itself sets (its device, process group, loop facts), not the
user: every other field is a setting (``settings()``: the keys of ``--elixir`` and ``ELIXIR_CONFIG``)."""


@dataclass(kw_only=True, frozen=True)
class ElixirConfig:
    """How ``elixir_runtime.prepare`` trains a model: flat keys (``ElixirConfig(**kwargs)``, the
    ``--elixir`` JSON), grouped by what they govern.

    ``mode="auto"`` derives whatever is left ``None`` from the model, the batch and the machine;
    ``mode="static"`` requires nothing more but uses exactly what is given (``None`` then means
    the simple default: chunk size from the model, rCache max, nothing offloaded).
    """

    # -- the plan: what the planner decides, or is told (planner.py, plan.py)
    mode: Literal["auto", "static"] = "auto"
    """``"auto"``: searched on a GPU from a profiled step and the machine; ``"static"``: exactly as given."""
    chunk_size: int | None = None
    """Elements per chunk, rounded up to a multiple of ``world_size * alignment``; a larger parameter gets its own chunk."""
    n_blocks: BlockCount | None = None
    """rCache size in chunks: an int, ``"min"`` (largest unit or checkpointed region) or ``"max"`` (every chunk)."""
    offload: float | Sequence[int] | None = None
    """Chunks whose shard and optimizer state live in pinned host memory, updated on the CPU: a
    fraction (the last chunks, whose gradients arrive first) or chunk indices; ``0``: none."""
    unit_classes: Sequence[type | str] | None = None
    """Module classes (or names) hooked as one fetch unit; ``None``: the model's ``_no_split_modules`` and
    every other module holding parameters."""
    alignment: int = field(default=64, metadata=_RUN)
    """Each parameter starts at a multiple of this many elements inside its chunk."""
    gpu_memory: int | str | None = None
    """The most GPU memory this process may use, per GPU (bytes, or a size such as ``"70GiB"``, stored
    as bytes): enforced by torch's allocator, and the plan fits within it (``gpu_limit.py``); ``None``:
    the whole card, or the fraction the user set."""
    activations: Where | Literal["auto"] = "auto"
    """Where the held block inputs wait for their block's recompute under activation checkpointing:
    ``"device"``; ``"host"``, pinned host memory, copied out in the forward and back ahead of the recompute
    on a side stream (``runtime/held_inputs.py``); ``"auto"``: the planner's choice of the two on a GPU
    (the shorter predicted step, or the one that fits), the device in a static plan."""
    device_assisted_update: bool | Literal["auto"] = False
    """Whether a GPU lane updates slices of offloaded chunks beside the CPU (``runtime/device_lane.py``;
    its staging memory is in the plan); ``"auto"``: where the planner predicts a shorter step (a GPU
    only). Off by default: measured, it did not pay (docs/runtime.md)."""

    # -- the runtime: how the engine runs the plan
    device: torch.device | str | None = field(default=None, metadata=_RUN)
    """Compute device; ``None``: ``cuda:<LOCAL_RANK>`` if CUDA is available, else the CPU."""
    process_group: dist.ProcessGroup | None = field(default=None, metadata=_RUN)
    """The ranks that shard the model; ``None``: the default group."""
    prefetch: int = 1
    """Upcoming chunks gathered ahead of use on side streams."""
    cpu_threads: int | None = None
    """Threads of the CPU Adam of offloaded chunks; ``None``: this rank's share of the host's cores less
    one (``kernels/threads.py``), whatever ``OMP_NUM_THREADS`` says."""
    lockstep_timeout_s: float = 60.0
    """Seconds a rank waits for the others at each forward and ``state_dict()`` before all fail naming
    the operation (``distributed/lockstep.py``) rather than hang until the process group's timeout."""
    record_update_rate: bool = True
    """Record the rate this job's CPU updated offloaded chunks at in this machine's cached hardware
    profile, which the next plan made here prices them at (``runtime/update_rate.py``)."""

    # -- numerics
    dtype: torch.dtype | str | None = None
    """Compute dtype of the gathered params and activations; ``None``: the model's own (never a silent
    change); ``"bf16"``/``"fp16"``: mixed precision with fp32 master weights."""
    moments: Moments = "fp32"
    """How Adam's moments are stored (``adam_state.py``): ``"fp32"``, exact AdamW; ``"8bit"``, block-wise
    8-bit moments beside fp32 master weights (about half the optimizer state's bytes; the update itself in fp32)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling, used in fp16 only."""
    skip_nonfinite: bool = True
    """Skip, on every rank, a step whose gradient norm is NaN or inf (one host sync per step, free when
    clipping); ``False``: plain PyTorch in bf16/fp32 (fp16 still skips overflows)."""
    max_consecutive_skips: int = 25
    """Training stops with an error after this many skipped steps in a row (more than fp16's 16
    back-offs from the default ``init_scale`` to ``min_scale``)."""

    # -- facts of the training loop, which the plan predicts with
    clips_grads: bool = field(default=True, metadata=_RUN)
    """The loop syncs the host before ``step()`` (``clip_grad_norm``, fp16): offloaded chunks' CPU
    updates are predicted to start after backward; ``False``: during it, as gradients land."""
    grad_accum_steps: int = field(default=1, metadata=_RUN)
    """Backwards per optimizer step. With one, on-device chunks' gradient shards are planned into
    memory the activations free (``search/memory.py``); with more they are counted beside them. The
    HF integration sets it from ``gradient_accumulation_steps``."""

    @property
    def state(self) -> AdamState:
        """The optimizer state each trainable element carries (``adam_state.ADAM_STATE``)."""
        return adam_state(self.moments)

    @property
    def layout_alignment(self) -> int:
        """Elements every parameter and shard starts at a multiple of: ``alignment`` and the state's block."""
        return math.lcm(self.alignment, self.state.alignment)

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The fields a user sets (every field but the run's own, which ``_RUN`` marks), in order."""
        return tuple(f.name for f in fields(cls) if not f.metadata.get("run"))

    def __post_init__(self) -> None:
        offload = self.offload
        classes = self.unit_classes
        _check(
            self,
            {
                "mode": (
                    self.mode in ("auto", "static"),
                    "'auto' (planned from the model and the machine) or 'static'",
                ),
                "dtype": (
                    self.dtype is None or isinstance(self.dtype, (str, torch.dtype)),
                    "'bf16', 'fp16', 'fp32' or None",
                ),
                "chunk_size": (
                    self.chunk_size is None or (_int(self.chunk_size) and self.chunk_size >= 1),
                    "a positive int (elements per chunk) or None (sized from the model)",
                ),
                "n_blocks": (
                    self.n_blocks is None
                    or self.n_blocks in ("min", "max")
                    or (_int(self.n_blocks) and self.n_blocks >= 1),
                    "an int >= 1 (chunks in the rCache), 'min', 'max' or None",
                ),
                "offload": (
                    offload is None
                    or (_real(offload) and 0 <= offload <= 1)
                    or (_indices(offload) and len(set(offload)) == len(offload)),
                    "a fraction of the chunks in [0, 1] (1.0: all), a list of distinct chunk indices, or None",
                ),
                "prefetch": (_int(self.prefetch) and self.prefetch >= 0, "an int >= 0 (chunks gathered ahead)"),
                "unit_classes": (
                    classes is None
                    or (isinstance(classes, (list, tuple)) and all(isinstance(c, (str, type)) for c in classes)),
                    "a list of module classes or class names such as ['GPT2Block'], or None",
                ),
                "device": (
                    self.device is None or isinstance(self.device, (str, torch.device)),
                    "a device such as 'cuda:0', or None",
                ),
                "process_group": (
                    self.process_group is None or isinstance(self.process_group, dist.ProcessGroup),
                    "a torch.distributed.ProcessGroup or None (the default group)",
                ),
                "loss_scale": (isinstance(self.loss_scale, LossScaleConfig), "a LossScaleConfig(...)"),
                "moments": (
                    self.moments in MOMENTS,
                    "'fp32' (exact AdamW) or '8bit' (fp32 master weights, block-wise 8-bit moments)",
                ),
                "alignment": (_int(self.alignment) and self.alignment >= 1, "an int >= 1 (elements)"),
                "cpu_threads": (
                    self.cpu_threads is None or (_int(self.cpu_threads) and self.cpu_threads >= 1),
                    "an int >= 1 or None",
                ),
                "clips_grads": (isinstance(self.clips_grads, bool), "True or False"),
                "grad_accum_steps": (
                    _int(self.grad_accum_steps) and self.grad_accum_steps >= 1,
                    "an int >= 1 (micro-batches per step)",
                ),
                "activations": (
                    self.activations in ("auto", "device", "host"),
                    "'auto' (the planner decides), 'device' (the GPU) or 'host' (pinned host memory)",
                ),
                "device_assisted_update": (
                    isinstance(self.device_assisted_update, bool) or self.device_assisted_update == "auto",
                    "True, False or 'auto' (the planner decides, on a GPU)",
                ),
                "lockstep_timeout_s": (
                    _real(self.lockstep_timeout_s) and self.lockstep_timeout_s > 0,
                    "a positive number of seconds such as 60",
                ),
                "skip_nonfinite": (isinstance(self.skip_nonfinite, bool), "True or False"),
                "record_update_rate": (isinstance(self.record_update_rate, bool), "True or False"),
                "max_consecutive_skips": (
                    _int(self.max_consecutive_skips) and self.max_consecutive_skips >= 1,
                    "an int >= 1 (skipped steps in a row)",
                ),
                "gpu_memory": (
                    self.gpu_memory is None or isinstance(self.gpu_memory, str) or _int(self.gpu_memory),
                    "a size such as '70GiB' or '70GB', an int of bytes, or None (the whole GPU)",
                ),
            },
        )
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", _gpu_memory(self.gpu_memory))
        if isinstance(self.device, str):
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ConfigError(
                    f"ElixirConfig.device {self.device!r} is not a device ({exc}); use e.g. 'cuda:0' or 'cpu'"
                ) from exc
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
            except ValueError as exc:
                raise ConfigError(f"ElixirConfig.dtype: {exc}") from exc

    @property
    def gpu_memory_bytes(self) -> int | None:
        """``gpu_memory`` as ``__post_init__`` leaves it: bytes (None: the whole GPU)."""
        return cast(int | None, self.gpu_memory)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """``dtype`` as ``__post_init__`` leaves it: a torch dtype (None: the model's own)."""
        return cast(torch.dtype | None, self.dtype)


MIN_SIZE = 2**20
"""The least memory size a setting takes (``ElixirConfig.gpu_memory``, ``elixir-plan``'s sizes): below it, a
forgotten unit."""


def _gpu_memory(value: int | str) -> int:
    """``ElixirConfig.gpu_memory`` in bytes: at least ``MIN_SIZE``."""
    fix = "give a size such as '70GiB' (binary) or '70GB' (decimal), or an int of bytes"
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"ElixirConfig.gpu_memory: {exc}; {fix}") from None
    if value < MIN_SIZE:
        raise ConfigError(
            f"ElixirConfig.gpu_memory must be at least 1 MiB, got {value!r} bytes; {fix}, or None for the whole GPU"
        )
    return value


_SIZE_UNITS = {
    "": 2**30,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """Bytes of a memory size: ``80GiB``, ``80G`` (binary), ``80GB`` (decimal), ``512MiB``, ``1024B``;
    a bare number is GiB. The one rule for ``ElixirConfig.gpu_memory`` and ``elixir-plan``'s sizes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 80GB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accepts torch dtypes and the usual short names; rejects anything that is not a float dtype we train in."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype
