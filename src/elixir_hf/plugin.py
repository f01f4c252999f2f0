"""``ElixirPlugin``: the ``ElixirConfig`` (and plan file) a user gives to the HF integration, and their grammar.

One spec string is accepted everywhere (``--elixir``, ``ELIXIR_CONFIG``, ``ElixirAccelerator``):
``off`` | ``auto`` | a JSON object of ``ElixirConfig`` fields (and ``PLUGIN_KEYS``, the plugin's own) | a
path to a ``.json`` file holding either such an object, a plan saved by an earlier run
(``elixir_plan.json``) or the ``--json`` report of the ``elixir-plan`` planner. A plan pins the
layout (static mode) and records the world size (and, when saved by a run, the model) it was made
for, so that a plan for another model or another number of ranks fails before any memory is
allocated.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypedDict

import torch

from elixir_runtime import ElixirConfig, ElixirPlan, LossScaleConfig
from elixir_runtime.config import resolve_dtype

__all__ = [
    "ACCEPTED",
    "ElixirPlugin",
    "ElixirSpecError",
    "ENV_VAR",
    "GRACE_ENV_VAR",
    "OFF_WORDS",
    "PLUGIN_KEYS",
    "describe_model",
    "check_exclusive",
    "spec_word",
]

ENV_VAR = "ELIXIR_CONFIG"
GRACE_ENV_VAR = "ELIXIR_PREEMPT_GRACE_S"
"""``ElixirPlugin.preempt_grace_s`` where the spec sets none."""
DEFAULT_GRACE_S = 30.0
"""torchrun's own grace between its SIGTERM and its SIGKILL (``--shutdown_timeout``)."""
OFF_WORDS = ("off", "false", "no", "none", "0")
"""Every spelling of off a user types (any case): Elixir is disabled."""
ACCEPTED = (
    "use 'auto', 'off' (or false/no/none/0), a JSON object such as '{\"offload\": 0.5}', or the path of an existing .json file "
    "(settings or a saved elixir_plan.json)"
)
"""The values a spec may take, as every refusal of one lists them."""


_PLAN_DTYPES = ("float32", "bfloat16", "float16")
"""The compute dtypes a plan file names (``ElixirPlan.dtype``)."""


def spec_word(text: str) -> str | None:
    """``"off"`` for every spelling of off, ``"auto"`` for auto (any case, spaces around), else ``None``."""
    word = text.strip().lower()
    return "off" if word in OFF_WORDS else "auto" if word == "auto" else None


_LOSS_SCALE_KEYS = {f.name for f in fields(LossScaleConfig)}
_SPEC_KEYS = ElixirConfig.settings()
"""The ``ElixirConfig`` fields a spec may set: all but the run's own (device, process group, alignment,
the loop's facts), as ``ElixirConfig`` marks them."""
PLUGIN_KEYS = ("lean_loss", "allow_missing_adam_state", "preempt_grace_s", "reference_offload")
"""The ``ElixirPlugin`` fields a spec may set (the HF glue's, not the engine's)."""
_MIXED_PRECISION_DTYPES = {"no": None, "fp16": "fp16", "bf16": "bf16"}
_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", "fp16": "fp16", "bf16": "bf16"}


class ElixirSpecError(ValueError):
    """A bad ``--elixir`` value, key or combination; the message names the fix."""


@dataclass
class ElixirPlugin:
    """What a user asked of the engine: an ``elixir_runtime.ElixirConfig`` (see its docs) and, when a
    plan file was given, the plan this run must follow."""

    config: ElixirConfig = field(default_factory=ElixirConfig)
    plan: ElixirPlan | None = None
    """The saved plan this run must follow (set by a plan file); checked against model and ranks, and
    by ``prepare`` against the model's layout before anything is allocated."""
    plan_model: ModelIdentity | None = None
    """The model the plan file was saved for (``describe_model``), when the file names one."""
    lean_loss: bool = True
    """Replace transformers' causal-LM loss (``ForCausalLMLoss``, a model's default) by
    ``elixir_hf.loss.lean_causal_lm_loss`` before the engine is built: the same value, without the
    fp32 copies of the logits (most of a large-vocabulary model's activation peak: docs/planning.md),
    so the planner keeps more optimizer state on the GPU. A loss function the user set is kept. ``False``:
    the stock loss."""
    allow_missing_adam_state: bool = False
    """A plain checkpoint (``optimizer.pt``/``optimizer.bin``) without Adam state for some trainable
    parameters loads, those starting at step 0 with zero moments (what torch does for a parameter that
    never had a gradient). ``False``: refused, naming them (``optimizer_files.load_optimizer``)."""
    preempt_grace_s: float | None = None
    """Seconds a preemption signal (SIGTERM, SIGUSR1) leaves the run to write a checkpoint, which it
    writes only if predicted to fit (``preemption.py``). ``None``: ``ELIXIR_PREEMPT_GRACE_S``, else
    ``DEFAULT_GRACE_S``; the seconds once parsed."""
    reference_offload: float = 1.0
    """Fraction of a reference model's chunks (TRL's ``DPOTrainer``: ``reference.frozen_engine``, frozen
    compute-dtype weights) kept in pinned host memory and uploaded for each forward; ``0``: all on the GPU."""

    def __post_init__(self) -> None:
        for name in ("lean_loss", "allow_missing_adam_state"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ElixirSpecError(
                    f"ElixirPlugin.{name} must be true or false, got {value!r} ({type(value).__name__})"
                )
        self.preempt_grace_s = _grace_s(self.preempt_grace_s)
        _check_lockstep_timeout(self.config.lockstep_timeout_s)
        share = self.reference_offload
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ElixirSpecError(
                f"ElixirPlugin.reference_offload must be a fraction in [0, 1] (1: every reference chunk in host "
                f"memory, 0: all on the GPU), got {share!r} ({type(share).__name__})"
            )
        self.reference_offload = float(share)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_spec(
        cls, spec: str | dict[str, Any] | bool | ElixirPlugin | None, source: str = "--elixir"
    ) -> ElixirPlugin | None:
        """Parses the spec grammar; ``None`` and ``OFF_WORDS`` mean Elixir is disabled (returns ``None``);
        a bool (a YAML config's ``elixir: true``/``off``) is ``auto`` or off. ``source`` (``--elixir``,
        ``ELIXIR_CONFIG``, a file's key, ...) is named in every error."""
        if spec is None or isinstance(spec, ElixirPlugin):
            return spec
        if isinstance(spec, bool):
            return cls() if spec else None
        if isinstance(spec, dict):
            return cls._from_mapping(dict(spec), source=source)
        text = str(spec).strip()
        if not text:  # not "off": most often a shell variable that expanded to nothing
            raise ElixirSpecError(f"{source} is empty ({spec!r}): {ACCEPTED}")
        word = spec_word(text)
        if word == "off":
            return None
        if word == "auto":
            return cls()
        if text.startswith("{"):
            try:
                return cls._from_mapping(json.loads(text), source=source)
            except json.JSONDecodeError as exc:
                raise ElixirSpecError(f"{source} is not valid JSON ({exc}): {text!r}") from exc
        path = Path(text)
        if path.suffix == ".json" and path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ElixirSpecError(f"{source} file {path} is not valid JSON: {exc}") from exc
            return cls._from_mapping(data, source=f"{source} file {path}")
        raise ElixirSpecError(f"{source} {text!r} is not understood: {ACCEPTED}")

    @classmethod
    def _from_mapping(cls, data: object, source: str) -> ElixirPlugin:
        if not isinstance(data, dict):
            raise ElixirSpecError(f"{source} must hold a JSON object, got {type(data).__name__}")
        if "n_chunks" in data and "world_size" in data:
            return cls._from_plan(data, source)
        if isinstance(data.get("plan"), dict):  # a report of the `elixir-plan` planner (``--json``)
            return cls._from_plan(data["plan"], source)
        valid = [*_SPEC_KEYS, *PLUGIN_KEYS]
        for key in data:
            if key not in valid:
                hint = difflib.get_close_matches(key, valid, n=1)
                did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ElixirSpecError(f"unknown {source} key {key!r}{did_you_mean}; valid keys: {', '.join(valid)}")
        return cls._built(source, **data)

    @classmethod
    def _built(
        cls,
        source: str,
        plan: ElixirPlan | None = None,
        plan_model: ModelIdentity | None = None,
        **kwargs: Any,
    ) -> ElixirPlugin:
        """``kwargs``: the spec keys (``_SPEC_KEYS`` and ``PLUGIN_KEYS``); ``loss_scale`` is an object of
        ``LossScaleConfig`` fields."""
        own = {key: kwargs.pop(key) for key in PLUGIN_KEYS if key in kwargs}
        loss_scale = kwargs.pop("loss_scale", {})
        if not isinstance(loss_scale, dict):
            raise ElixirSpecError(
                f'{source}: loss_scale must be an object such as {{"init_scale": 1024}}, got {loss_scale!r}'
            )
        unknown = set(loss_scale) - _LOSS_SCALE_KEYS
        if unknown:
            raise ElixirSpecError(
                f"{source}: unknown loss_scale key(s) {sorted(unknown)}; valid keys: {sorted(_LOSS_SCALE_KEYS)}"
            )
        try:  # the config's and the plugin's own checks, one copy of each rule
            config = ElixirConfig(loss_scale=LossScaleConfig(**loss_scale), **kwargs)
            return cls(config=config, plan=plan, plan_model=plan_model, **own)
        except ValueError as exc:
            raise ElixirSpecError(f"{source}: {exc}") from exc

    @classmethod
    def _from_plan(cls, data: dict[str, Any], source: str) -> ElixirPlugin:
        try:
            plan = ElixirPlan.from_dict({k: v for k, v in data.items() if k != "model"}, source)
        except ValueError as exc:  # the reader names the source: a format it does not read, unknown keys
            raise ElixirSpecError(str(exc)) from exc
        except TypeError as exc:
            raise ElixirSpecError(f"{source} looks like a plan but is not one: {exc}") from exc
        if plan.dtype not in _PLAN_DTYPES:
            raise ElixirSpecError(
                f"{source}: the plan's dtype is {plan.dtype!r}; a plan is made for one of {list(_PLAN_DTYPES)} (was "
                "the file edited? plan again with elixir-plan, or pass --elixir auto)"
            )
        return cls._built(source, **plan.settings(), plan=plan, plan_model=data.get("model"))

    # ------------------------------------------------------------------ resolution
    def resolve_dtype(self, mixed_precision: str | None) -> None:
        """Fills the config's ``dtype`` from HF/accelerate mixed precision; the engine owns precision,
        so a conflicting explicit choice is an error rather than a silent override."""
        mp = (mixed_precision or "no").lower()
        if mp not in _MIXED_PRECISION_DTYPES:
            raise ElixirSpecError(f"mixed precision {mp!r} is not supported with Elixir; use bf16, fp16 or no (fp32)")
        wanted = _MIXED_PRECISION_DTYPES[mp]
        dtype = self.config.dtype
        if dtype is None:
            dtype = wanted
        elif wanted is not None and _canonical(dtype) != _canonical(wanted):
            raise ElixirSpecError(
                f"--elixir asks for dtype {_SHORT_NAMES[dtype]!r} but mixed precision is {mp!r}; drop one of them"
            )
        if self.plan is not None and _canonical(dtype or self.plan.dtype) != _canonical(self.plan.dtype):
            raise ElixirSpecError(
                f"the plan file was made for {self.plan.dtype} but this run computes in {_SHORT_NAMES[dtype]}: pass the "
                "matching --bf16/--fp16 flag, or re-plan with --elixir auto"
            )
        if dtype is None and self.plan is not None:
            dtype = self.plan.dtype
        self.config = replace(self.config, dtype=dtype)

    def check_world_size(self, world_size: int) -> None:
        if self.plan is not None and self.plan.world_size != world_size:
            raise ElixirSpecError(
                f"the plan file was made for {self.plan.world_size} rank(s) but this run has {world_size}: "
                f"launch {self.plan.world_size} processes, or re-plan with --elixir auto"
            )

    def check_model(self, model: torch.nn.Module) -> None:
        """Before the engine is built: a plan that names its model must name this one."""
        saved = self.plan_model
        if saved and saved != describe_model(model):
            raise ElixirSpecError(
                f"the plan file was made for another model ({saved}) than this one ({describe_model(model)}): "
                "re-plan with --elixir auto, or load the model the plan was made for"
            )


_OTHER_ENGINES = {  # name: (launcher environment switch, how the user asked for it)
    "DeepSpeed": ("ACCELERATE_USE_DEEPSPEED", "--deepspeed or an accelerate config with distributed_type DEEPSPEED"),
    "FSDP": ("ACCELERATE_USE_FSDP", "--fsdp or an accelerate config with distributed_type FSDP"),
    "Megatron-LM": ("ACCELERATE_USE_MEGATRON_LM", "an accelerate config with distributed_type MEGATRON_LM"),
}


def check_exclusive(requested: dict[str, bool]) -> None:
    """Elixir shards, offloads and reduces the model itself: no other engine may wrap it.

    ``requested`` maps an engine name to whether the caller asked for it; the accelerate
    launcher's environment switches are checked as well.
    """
    for name, (env, source) in _OTHER_ENGINES.items():
        if requested.get(name) or os.environ.get(env, "false").lower() in ("1", "true", "yes"):
            raise ElixirSpecError(
                f"Elixir cannot be combined with {name}: both shard the model. Drop {source} (launch with "
                "recipes/elixir.yaml instead), or turn Elixir off with --elixir off"
            )


ModelIdentity = TypedDict("ModelIdentity", {"class": str, "model_type": str | None, "parameters": int})
"""What identifies a model for a plan (``describe_model``; a plan file's ``model``)."""


def describe_model(model: torch.nn.Module) -> ModelIdentity:
    """What identifies a model for a plan: its class, HF model type and parameter count."""
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


LOCKSTEP_TIMEOUT_RANGE_S = (1.0, 7 * 86400.0)
"""``lockstep_timeout_s`` that can work: below a second a rank's beat (a tenth of it, at least 0.05 s)
misses it under an ordinary pause (a collection, a loaded host) and a live rank is called stopped; above
a week the timers overflow, and no job waits that long for a rank."""


def _check_lockstep_timeout(value: float) -> None:
    low, high = LOCKSTEP_TIMEOUT_RANGE_S
    if not low <= value <= high:
        raise ElixirSpecError(
            f"lockstep_timeout_s is {value!r}: it must be {low:g} to {high:g} seconds (the default, 60, suits most "
            "jobs; a few seconds only in tests)"
        )


def _grace_s(value: object) -> float:
    """``preempt_grace_s``'s seconds: ``value``, else the environment's, else the default; checked."""
    source = "ElixirPlugin.preempt_grace_s"
    if value is None:
        text = os.environ.get(GRACE_ENV_VAR)
        if text is None:
            return DEFAULT_GRACE_S
        source = GRACE_ENV_VAR
        try:
            value = float(text)
        except ValueError:
            value = text
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ElixirSpecError(
            f"{source} must be a number of seconds >= 0 such as 30 (0: no checkpoint on a preemption signal), "
            f"got {value!r}"
        )
    return float(value)


def _canonical(dtype: str | torch.dtype) -> str:
    return str(resolve_dtype(dtype)).removeprefix("torch.")
