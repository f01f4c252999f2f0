"""``ElixirPlugin``: the engine settings a user gives to the HF integration, and their grammar.

One spec string is accepted everywhere (``--elixir``, ``ELIXIR_CONFIG``, ``ElixirAccelerator``):
``off`` | ``auto`` | a JSON object of plugin fields | a path to a ``.json`` file holding either
such an object, a plan saved by an earlier run (``elixir_plan.json``) or the ``--json`` report of
the ``elixir-plan`` planner. A plan pins the layout (static mode) and records the world size (and,
when saved by a run, the model) it was made for, so that a plan for another model or another
number of ranks fails before any memory is allocated.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from elixir_runtime import ElixirConfig, ElixirPlan, LossScaleConfig
from elixir_runtime.config import resolve_dtype

__all__ = ["ElixirPlugin", "ElixirSpecError", "ENV_VAR", "describe_model", "check_exclusive"]

ENV_VAR = "ELIXIR_CONFIG"

_LOSS_SCALE_KEYS = {f.name for f in fields(LossScaleConfig)}
_MIXED_PRECISION_DTYPES = {"no": None, "fp16": "fp16", "bf16": "bf16"}


class ElixirSpecError(ValueError):
    """A bad ``--elixir`` value, key or combination; the message names the fix."""


@dataclass
class ElixirPlugin:
    """Engine settings; every field maps onto ``elixir_runtime.ElixirConfig`` (see its docs)."""

    mode: str = "auto"
    dtype: str | None = None
    """``fp16``/``bf16``/``fp32``; ``None`` takes ``--fp16/--bf16`` (or accelerate's mixed_precision)."""
    chunk_size: int | None = None
    n_blocks: int | str | None = None
    offload: float | list[int] | None = None
    prefetch: int = 1
    unit_classes: list[str] | None = None
    cpu_threads: int | None = None
    """Threads of the CPU Adam; ``None``: the rank's share of the host's cores less one."""
    lockstep_timeout_s: float = 60.0
    """Seconds a rank waits for the others at the start of a forward before failing (rank-local forwards)."""
    loss_scale: dict[str, float] = field(default_factory=dict)
    """``LossScaleConfig`` fields, e.g. ``{"init_scale": 1024}`` (fp16 only)."""
    skip_nonfinite: bool = True
    max_consecutive_skips: int = 25
    plan: dict[str, Any] | None = None
    """The saved plan this run must follow (set by a plan file); checked against model and ranks."""

    def __post_init__(self) -> None:
        if not isinstance(self.loss_scale, dict):
            raise ElixirSpecError(f"loss_scale must be an object such as {{\"init_scale\": 1024}}, got {self.loss_scale!r}")
        unknown = set(self.loss_scale) - _LOSS_SCALE_KEYS
        if unknown:
            raise ElixirSpecError(f"unknown loss_scale key(s) {sorted(unknown)}; valid keys: {sorted(_LOSS_SCALE_KEYS)}")
        try:
            self.to_config()
        except ValueError as exc:  # the config's own checks (ConfigError), one copy of each rule
            raise ElixirSpecError(str(exc)) from exc

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_spec(cls, spec: "str | dict | ElixirPlugin | None", source: str = "--elixir") -> "ElixirPlugin | None":
        """Parses the spec grammar; ``None``/``"off"`` mean Elixir is disabled (returns ``None``).
        ``source`` (``--elixir``, ``ELIXIR_CONFIG``, ...) is named in every error."""
        if spec is None or isinstance(spec, ElixirPlugin):
            return spec
        if isinstance(spec, dict):
            return cls._from_mapping(dict(spec), source=source)
        text = str(spec).strip()
        if text in ("", "off"):
            return None
        if text == "auto":
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
        raise ElixirSpecError(
            f"{source} {text!r} is not understood: use 'auto', 'off', a JSON object such as "
            "'{\"offload\": 0.5}', or the path of an existing .json file (settings or a saved elixir_plan.json)"
        )

    @classmethod
    def _from_mapping(cls, data: Any, source: str) -> "ElixirPlugin":
        if not isinstance(data, dict):
            raise ElixirSpecError(f"{source} must hold a JSON object, got {type(data).__name__}")
        if "n_chunks" in data and "world_size" in data:
            return cls._from_plan(data, source)
        if isinstance(data.get("plan"), dict):  # a report of the `elixir-plan` planner (``--json``)
            return cls._from_plan(data["plan"], source)
        valid = [f.name for f in fields(cls) if f.name != "plan"]
        for key in data:
            if key not in valid:
                hint = difflib.get_close_matches(key, valid, n=1)
                did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ElixirSpecError(f"unknown {source} key {key!r}{did_you_mean}; valid keys: {', '.join(valid)}")
        return cls._built(source, **data)

    @classmethod
    def _built(cls, source: str, **kwargs: Any) -> "ElixirPlugin":
        try:
            return cls(**kwargs)
        except ElixirSpecError as exc:
            raise ElixirSpecError(f"{source}: {exc}") from exc

    @classmethod
    def _from_plan(cls, data: dict, source: str) -> "ElixirPlugin":
        try:
            ElixirPlan.from_dict({k: v for k, v in data.items() if k != "model"})
        except (TypeError, ValueError) as exc:
            raise ElixirSpecError(f"{source} looks like a plan but is not one: {exc}") from exc
        return cls._built(
            source,
            mode="static",
            chunk_size=data["chunk_size"],
            n_blocks=data["n_blocks"],
            offload=list(data["offload"]),
            plan=dict(data),
        )

    # ------------------------------------------------------------------ resolution
    def resolve_dtype(self, mixed_precision: str | None) -> None:
        """Fills ``dtype`` from HF/accelerate mixed precision; the engine owns precision, so a
        conflicting explicit choice is an error rather than a silent override."""
        mp = (mixed_precision or "no").lower()
        if mp not in _MIXED_PRECISION_DTYPES:
            raise ElixirSpecError(
                f"mixed precision {mp!r} is not supported with Elixir; use bf16, fp16 or no (fp32)"
            )
        wanted = _MIXED_PRECISION_DTYPES[mp]
        if self.dtype is None:
            self.dtype = wanted
        elif wanted is not None and _canonical(self.dtype) != _canonical(wanted):
            raise ElixirSpecError(
                f"--elixir asks for dtype {self.dtype!r} but mixed precision is {mp!r}; drop one of them"
            )
        if self.plan is not None and _canonical(self.dtype or self.plan["dtype"]) != _canonical(self.plan["dtype"]):
            raise ElixirSpecError(
                f"the plan file was made for {self.plan['dtype']} but this run computes in {self.dtype}: pass the "
                "matching --bf16/--fp16 flag, or re-plan with --elixir auto"
            )
        if self.dtype is None and self.plan is not None:
            self.dtype = self.plan["dtype"]

    def check_world_size(self, world_size: int) -> None:
        if self.plan is not None and self.plan["world_size"] != world_size:
            raise ElixirSpecError(
                f"the plan file was made for {self.plan['world_size']} rank(s) but this run has {world_size}: "
                f"launch {self.plan['world_size']} processes, or re-plan with --elixir auto"
            )

    def check_model(self, model: torch.nn.Module) -> None:
        """Before the engine is built: a plan that names its model must name this one."""
        saved = (self.plan or {}).get("model")
        if saved and saved != describe_model(model):
            raise ElixirSpecError(
                f"the plan file was made for another model ({saved}) than this one ({describe_model(model)}): "
                "re-plan with --elixir auto, or load the model the plan was made for"
            )

    def check_plan(self, plan: ElixirPlan) -> None:
        """After the engine is built: the layout must be the one the plan file describes."""
        if self.plan is None:
            return
        got = {k: getattr(plan, k) for k in ("n_chunks", "chunk_size", "world_size")}
        want = {k: self.plan[k] for k in got}
        if got != want:
            raise ElixirSpecError(
                f"the plan file does not fit this model: it describes {want}, this model gives {got}; "
                "re-plan with --elixir auto, or load the model the plan was made for"
            )

    def to_config(self, device: torch.device | str | None = None) -> ElixirConfig:
        return ElixirConfig(
            mode=self.mode,  # type: ignore[arg-type]
            dtype=self.dtype,
            chunk_size=self.chunk_size,
            n_blocks=self.n_blocks,  # type: ignore[arg-type]
            offload=self.offload,
            prefetch=self.prefetch,
            unit_classes=self.unit_classes,
            cpu_threads=self.cpu_threads,
            lockstep_timeout_s=self.lockstep_timeout_s,
            device=device,
            loss_scale=LossScaleConfig(**self.loss_scale),
            skip_nonfinite=self.skip_nonfinite,
            max_consecutive_skips=self.max_consecutive_skips,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def describe_model(model: torch.nn.Module) -> dict[str, Any]:
    """What identifies a model for a plan: its class, HF model type and parameter count."""
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _canonical(dtype: str) -> str:
    return str(resolve_dtype(dtype)).removeprefix("torch.")
