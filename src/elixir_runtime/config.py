"""User-facing configuration of the engine: what to run, not how it is laid out.

``ElixirConfig()`` means: automatic plan, compute in the model's own dtype. Every field of a
*static* plan can be forced here so that tests (and users who know better) get any shape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist

__all__ = ["ConfigError", "ElixirConfig", "LossScaleConfig", "PlanError", "parse_size", "resolve_dtype"]

BlockCount = int | Literal["min", "max"]


class PlanError(ValueError):
    """The requested plan cannot run; the message names the numbers and the fix."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field, the value and what to use.

    Raised while the config is built, before anything runs (``elixir_hf`` adds where the value
    came from: ``--elixir``, ``ELIXIR_CONFIG`` or a file)."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(config: object, rules: dict[str, tuple[bool, str]]) -> None:
    """``rules``: field name -> (whether its value is valid, what a valid value is)."""
    for name, (ok, need) in rules.items():
        if not ok:
            value = getattr(config, name)
            raise ConfigError(
                f"{type(config).__name__}.{name} must be {need}, got {value!r} ({type(value).__name__})"
            )


@dataclass(kw_only=True, frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, used only when the compute dtype is float16 (defaults as torch's GradScaler)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        _check(self, {
            "init_scale": (_real(self.init_scale) and self.init_scale > 0, "a positive finite number such as 65536.0"),
            "growth_factor": (_real(self.growth_factor) and self.growth_factor > 1, "a finite number > 1 such as 2.0"),
            "backoff_factor": (_real(self.backoff_factor) and 0 < self.backoff_factor < 1, "a number in (0, 1) such as 0.5"),
            "growth_interval": (_int(self.growth_interval) and self.growth_interval >= 1, "an int >= 1 (steps) such as 2000"),
            "min_scale": (
                _real(self.min_scale) and 0 < self.min_scale <= (self.init_scale if _real(self.init_scale) else math.inf),
                "a positive finite number no larger than init_scale, such as 1.0",
            ),
        })


@dataclass(kw_only=True, frozen=True)
class ElixirConfig:
    """How ``elixir_runtime.prepare`` trains a model.

    ``mode="auto"`` derives whatever is left ``None`` from the model, the batch and the machine;
    ``mode="static"`` requires nothing more but uses exactly what is given (``None`` then means
    the simple default: chunk size from the model, rCache max, nothing offloaded).
    """

    mode: Literal["auto", "static"] = "auto"
    dtype: torch.dtype | str | None = None
    """Compute dtype of the gathered params (and so of activations). ``None``: the model's own dtype,
    never a silent precision change. ``"bf16"``/``"fp16"``: mixed precision with fp32 master weights."""

    chunk_size: int | None = None
    """Elements per chunk (rounded up to a multiple of ``world_size * alignment``). A parameter larger
    than this (an untied embedding) gets a chunk of its own size, outside the rCache."""

    n_blocks: BlockCount | None = None
    """rCache size in chunks: an int, ``"min"`` (largest hooked unit) or ``"max"`` (every chunk)."""

    offload: float | Sequence[int] | None = None
    """Which chunks keep their shard and optimizer states in (pinned) host memory and are updated on
    the CPU: a fraction of the chunks (the ones whose gradients arrive first in backward) or
    explicit chunk indices. ``0`` keeps everything on the compute device."""

    prefetch: int = 1
    """How many upcoming chunks to gather ahead of use on side streams."""

    unit_classes: Sequence[type | str] | None = None
    """Module classes (or class names) hooked as one fetch unit, FSDP2 style. ``None``: the model's
    ``_no_split_modules`` (its transformer blocks), and every other module holding parameters."""

    device: torch.device | str | None = None
    """Compute device. ``None``: ``cuda:<LOCAL_RANK>`` if CUDA is available, else CPU."""

    process_group: dist.ProcessGroup | None = None
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    alignment: int = 64
    """Each parameter starts at a multiple of this many elements inside its chunk (fast kernels)."""

    cpu_threads: int | None = None
    """Threads of the CPU Adam of offloaded chunks. ``None``: this rank's share of the host's cores
    less one for the training loop (``kernels/threads.py``), whatever ``OMP_NUM_THREADS`` says."""

    clips_grads: bool = True
    """Whether the training loop calls ``clip_grad_norm`` (or trains in fp16): one host sync before
    the update, so the CPU Adam of offloaded chunks starts only after backward; the planner
    predicts the overlap accordingly. ``False`` (no clipping, bf16/fp32): the host runs ahead of
    the GPU and those updates start during backward, as each chunk's gradients land."""

    grad_accum_steps: int = 1
    """Micro-batches (backwards) per optimizer step. With one, the gradient shards of GPU-resident
    chunks exist only from backward to ``zero_grad``, after the loss's activation peak, and the plan
    lets them use the memory it frees (``search/memory.py``); with more they stay through the next
    micro-batches' forwards and are counted beside the activations. A forward with gradients held
    under a one-micro-batch plan warns: it may run out of GPU memory. The HF integration sets it
    from ``gradient_accumulation_steps``."""

    device_assisted_update: bool | Literal["auto"] = False
    """Whether the GPU helps the CPU update offloaded chunks. After a clipped backward the CPU Adam of
    offloaded chunks runs while the link and the GPU idle; with this on, a second lane streams slices
    of their states to the GPU, updates them with the GPU kernel and copies them back, while the CPU
    updates the others (the two split the work as they go; ``runtime/device_lane.py``). It takes two
    staging buffers of GPU memory (0.875 GiB in bf16, counted in the plan), and its copies take the
    host memory bandwidth the CPU update needs: measured on H100s (clipping on) it did not pay,
    Llama-3-8B on one 303 vs 299 TFLOPS, GPT2-20b on four 360 vs 416 (batch 4) and 492 vs 484
    (batch 8), so it is off by default. ``"auto"``: the planner keeps it where its predicted step is
    shorter (a GPU only); ``True`` on (also on a CPU device, a second CPU thread: tests)."""

    lockstep_timeout_s: float = 60.0
    """How long a rank waits for the others when it starts a forward or gathers the weights (a
    host-side check that every rank is starting the same operation, ``runtime/lockstep.py``).
    A forward run on some ranks only (outside ``full_params``) fails on every rank within this
    time, naming the cause, instead of hanging until the process group's timeout (30 minutes).
    Raise it if a rank legitimately works alone for longer while the others wait in their next
    forward (rather than in a barrier)."""

    skip_nonfinite: bool = True
    """Skip (on every rank, with a warning) an optimizer step whose gradient norm is NaN or inf, as
    fp16's loss scaling always does; counted in ``elixir/skipped_steps``. It needs the global grad
    norm every step: one host sync, free when clipping (it computes the norm anyway), otherwise it
    ends the overlap of offloaded chunks' CPU updates with the end of backward (see
    ``clips_grads``). ``False``: plain PyTorch behaviour in bf16/fp32 (one NaN step makes the
    weights NaN); fp16 still skips overflows."""

    max_consecutive_skips: int = 25
    """Training stops with an error after this many skipped steps in a row: more than the 16
    back-offs fp16 loss scaling needs from the default ``init_scale`` 2**16 to ``min_scale`` 1."""

    gpu_memory: int | str | None = None
    """The most GPU memory this process may use, per GPU: an int of bytes, or a size string
    (``"70GiB"``/``"70G"`` binary, ``"70GB"`` decimal, ``"512MiB"``; no unit: GiB, as
    ``elixir-plan --gpu-mem``), stored as bytes. ``prepare`` lowers torch's per-process memory
    fraction to ``gpu_memory / total`` (``torch.cuda.set_per_process_memory_fraction``; a smaller
    fraction the user set stays), so the caching allocator enforces it (its out-of-memory error
    then says "... allowed"), and the plan fits what is left of it (``gpu_limit.py``). For a GPU
    shared with other jobs, for headroom, or to plan as on a smaller card. ``None``: the whole
    card, or the fraction the user set."""

    def __post_init__(self) -> None:
        offload = self.offload
        indices = isinstance(offload, (list, tuple)) and all(_int(i) and i >= 0 for i in offload)
        classes = self.unit_classes
        _check(self, {
            "mode": (self.mode in ("auto", "static"), "'auto' (planned from the model and the machine) or 'static'"),
            "dtype": (self.dtype is None or isinstance(self.dtype, (str, torch.dtype)), "'bf16', 'fp16', 'fp32' or None"),
            "chunk_size": (
                self.chunk_size is None or (_int(self.chunk_size) and self.chunk_size >= 1),
                "a positive int (elements per chunk) or None (sized from the model)",
            ),
            "n_blocks": (
                self.n_blocks is None or self.n_blocks in ("min", "max") or (_int(self.n_blocks) and self.n_blocks >= 1),
                "an int >= 1 (chunks in the rCache), 'min', 'max' or None",
            ),
            "offload": (
                offload is None or (_real(offload) and 0 <= offload <= 1) or (indices and len(set(offload)) == len(offload)),
                "a fraction of the chunks in [0, 1] (1.0: all), a list of distinct chunk indices, or None",
            ),
            "prefetch": (_int(self.prefetch) and self.prefetch >= 0, "an int >= 0 (chunks gathered ahead)"),
            "unit_classes": (
                classes is None
                or (isinstance(classes, (list, tuple)) and all(isinstance(c, (str, type)) for c in classes)),
                "a list of module classes or class names such as ['GPT2Block'], or None",
            ),
            "device": (
                self.device is None or isinstance(self.device, (str, torch.device)), "a device such as 'cuda:0', or None"
            ),
            "process_group": (
                self.process_group is None or isinstance(self.process_group, dist.ProcessGroup),
                "a torch.distributed.ProcessGroup or None (the default group)",
            ),
            "loss_scale": (isinstance(self.loss_scale, LossScaleConfig), "a LossScaleConfig(...)"),
            "alignment": (_int(self.alignment) and self.alignment >= 1, "an int >= 1 (elements)"),
            "cpu_threads": (
                self.cpu_threads is None or (_int(self.cpu_threads) and self.cpu_threads >= 1), "an int >= 1 or None"
            ),
            "clips_grads": (isinstance(self.clips_grads, bool), "True or False"),
            "grad_accum_steps": (_int(self.grad_accum_steps) and self.grad_accum_steps >= 1, "an int >= 1 (micro-batches per step)"),
            "device_assisted_update": (
                isinstance(self.device_assisted_update, bool) or self.device_assisted_update == "auto",
                "True, False or 'auto' (the planner decides, on a GPU)",
            ),
            "lockstep_timeout_s": (
                _real(self.lockstep_timeout_s) and self.lockstep_timeout_s > 0, "a positive number of seconds such as 60"
            ),
            "skip_nonfinite": (isinstance(self.skip_nonfinite, bool), "True or False"),
            "max_consecutive_skips": (
                _int(self.max_consecutive_skips) and self.max_consecutive_skips >= 1, "an int >= 1 (skipped steps in a row)"
            ),
            "gpu_memory": (
                self.gpu_memory is None or isinstance(self.gpu_memory, str) or _int(self.gpu_memory),
                "a size such as '70GiB' or '70GB', an int of bytes, or None (the whole GPU)",
            ),
        })
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", _gpu_memory(self.gpu_memory))
        if isinstance(self.device, str):
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ConfigError(f"ElixirConfig.device {self.device!r} is not a device ({exc}); use e.g. 'cuda:0' or 'cpu'") from exc
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
            except ValueError as exc:
                raise ConfigError(f"ElixirConfig.dtype: {exc}") from exc


def _gpu_memory(value: int | str) -> int:
    """``ElixirConfig.gpu_memory`` in bytes: at least 1 MiB (a small int is a forgotten unit)."""
    fix = "give a size such as '70GiB' (binary) or '70GB' (decimal), or an int of bytes"
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"ElixirConfig.gpu_memory: {exc}; {fix}") from None
    if value < 2**20:
        raise ConfigError(
            f"ElixirConfig.gpu_memory must be at least 1 MiB, got {value!r} bytes; {fix}, or None for the whole GPU"
        )
    return value


_SIZE_UNITS = {"": 2**30, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


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
