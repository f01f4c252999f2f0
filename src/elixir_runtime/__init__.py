"""elixir_runtime: chunk-based ZeRO with an rCache and partial CPU offload (no transformers: torch, and numpy,
safetensors and filelock for the search, weight files and the C++ kernel's build).

model, optimizer = elixir_runtime.prepare(model, torch.optim.AdamW(model.parameters()), example_batch=batch)
loss = model(**batch).loss
optimizer.backward(loss)
optimizer.clip_grad_norm(1.0)
optimizer.step(); optimizer.zero_grad()
with elixir_runtime.full_params(model):   # every rank; then forwards on any rank (sampling, eval)
    ...
elixir_runtime.park(model)                # model.parameters() read the trained values until the next step
elixir_runtime.release(model)             # the engine off, its memory freed; prepare may take the model again
elixir_runtime.compile_blocks(model)      # torch.compile each decoder layer, the chunk hooks outside

Besides training, the names below cover a model's weights kept in their files until ``prepare``
(``CheckpointFiles``, ``stream_weights``, ``attached_weights``) and the optimizer state by parameter
name (``named_state``, ``load_named``: any rank count and plan). The other public faces are
``config`` (settings), ``planner`` (plans, without a GPU), ``hardware`` (the machine: its profile,
memory, cores and Adam kernels) and ``progress`` (the bars' protocol); ``elixir_hf`` imports the
engine through these alone (tests/test_layers.py).
"""

from .adam_state import ADAM_STATE, MOMENTS, AdamState, StateTensor, adam_state
from .api import ElixirState, prepare, release
from .compile import CompileStats, check_compile_options, compile_blocks, compile_stats
from .config import ElixirConfig, LossScaleConfig, PlanError
from .distributed.heartbeat import armed
from .distributed.lockstep import LockstepError
from .kernels.quant8 import decode_state
from .optim.named_state import (
    NamedMeta,
    ParamEntry,
    Reader,
    load_named,
    named_meta,
    named_state,
    plain_to_named,
    saved_state,
)
from .optim.optimizer import ElixirOptimizer
from .plan import ElixirPlan
from .runtime.full_params import Parked, full_params, park
from .runtime.hooks import PlaceholderReadError
from .state_dict import load_safetensors, rank0_state_dict
from .weights.attached import attached_weights, detach_weights
from .weights.init import InitError, init_weights
from .weights.stream import INDEX_FILE, SINGLE_FILE, CheckpointFiles, WeightsError, stream_weights

__all__ = [
    "armed",
    "prepare",
    "release",
    "park",
    "Parked",
    "ElixirConfig",
    "LossScaleConfig",
    "ElixirOptimizer",
    "ElixirPlan",
    "PlanError",
    "ElixirState",
    "load_safetensors",
    "CheckpointFiles",
    "SINGLE_FILE",
    "INDEX_FILE",
    "stream_weights",
    "attached_weights",
    "detach_weights",
    "init_weights",
    "InitError",
    "WeightsError",
    "rank0_state_dict",
    "full_params",
    "LockstepError",
    "PlaceholderReadError",
    "compile_blocks",
    "check_compile_options",
    "compile_stats",
    "CompileStats",
    "named_state",
    "NamedMeta",
    "ParamEntry",
    "Reader",
    "named_meta",
    "load_named",
    "plain_to_named",
    "saved_state",
    "decode_state",
    "ADAM_STATE",
    "MOMENTS",
    "AdamState",
    "StateTensor",
    "adam_state",
]
