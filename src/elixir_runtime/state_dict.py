"""Consolidated ``model.state_dict()`` / ``load_state_dict()`` for a chunked model, from any layout.

``state_dict()`` gathers each chunk once (fp32 master for trainable chunks, so a bf16 run of an
fp32 model saves its exact fp32 weights) and returns every parameter in its original dtype on the
CPU, under every name it has (tied weights share one tensor, as in plain PyTorch; HF's
``save_pretrained`` then writes them once). It is a collective: call it on every rank. Inside
``rank0_state_dict(model)`` only rank 0 (or the ranks that ask to) keeps the weights (a checkpoint writer's need: one copy
of the model in host memory, not one per rank). ``load_state_dict()`` writes each rank's part of
the given full tensors into its shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .chunk.store import write_param
from .distributed.lockstep import Op
from .progress import track
from .runtime.chunk_runtime import ChunkRuntime

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["ModelStateHooks", "load_safetensors", "rank0_state_dict"]


@contextlib.contextmanager
def rank0_state_dict(model: nn.Module, keep: bool | None = None) -> Iterator[None]:
    """Inside, ``model.state_dict()`` (still a collective) consolidates the weights on rank 0 only;
    the other ranks' dicts hold no parameters. For saving: rank 0 writes, and the host holds one
    copy of the model instead of one per rank (FSDP's ``rank0_only``). ``keep``: whether this rank
    keeps them instead of rank 0 alone (the writer of each node, when every node saves to a disk of
    its own)."""
    state = getattr(model, "_elixir", None)
    if state is None:
        raise ValueError("rank0_state_dict needs a model prepared by elixir_runtime.prepare")
    state.model_state.keep = state.runtime.coll.rank == 0 if keep is None else keep
    try:
        yield
    finally:
        state.model_state.keep = True


class ModelStateHooks:
    def __init__(self, runtime: ChunkRuntime, orig_dtypes: list[torch.dtype]) -> None:
        self.runtime, self.orig_dtypes = runtime, orig_dtypes
        self._loaded: set[str] = set()
        self.keep = True
        """Whether this rank copies the gathered weights to the host (``rank0_state_dict`` sets it)."""

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        # torch tags hook objects with attributes, which bound methods refuse: wrap them
        return [
            model.register_state_dict_post_hook(lambda *a: self._state_dict_post(*a)),
            model.register_load_state_dict_pre_hook(lambda *a: self._load_pre(*a)),
            model.register_load_state_dict_post_hook(lambda *a: self._load_post(*a)),
        ]

    @torch.no_grad()
    def full_params(self) -> list[torch.Tensor | None]:
        """Every parameter, consolidated, on the CPU in its original dtype (a collective); ``None``
        for all of them on a rank that does not ``keep`` them (``rank0_state_dict``)."""
        rt, layout = self.runtime, self.runtime.layout
        rt.lockstep.check_in(Op.STATE_DICT)
        rt.grads.wait_for_grads()
        keep = self.keep
        out: list[torch.Tensor | None] = [None] * len(layout.params)
        for c in track(rt.chunks, "elixir: gathering the weights", unit="chunk"):
            src = c.shards.master if c.spec.trainable else c.shards.param
            full = torch.empty(c.spec.numel, dtype=src.dtype, device=rt.device)
            rt.coll.shard_of(full).copy_(src[c.offset : c.offset + c.shard_numel])
            rt.coll.all_gather_(full)
            if not keep:
                continue
            host = full.cpu()
            for s in c.spec.slots:
                shape = layout.params[s.param].shape
                out[s.param] = host[s.offset : s.offset + s.numel].view(shape).to(self.orig_dtypes[s.param]).clone()
        return out

    def _state_dict_post(self, _module: nn.Module, state_dict: dict[str, object], prefix: str, _meta: object) -> None:
        for i, tensor in enumerate(self.full_params()):
            for name in self.runtime.layout.names[i]:
                if prefix + name not in state_dict:
                    continue
                if tensor is None:
                    del state_dict[prefix + name]
                else:
                    state_dict[prefix + name] = tensor

    @torch.no_grad()
    def _load_pre(
        self,
        _m: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        _meta: object,
        _strict: bool,
        _missing: list[str],
        _unexpected: list[str],
        error_msgs: list[str],
    ) -> None:
        self._loaded = set()
        for i, names in enumerate(self.runtime.layout.names):
            keys = [prefix + n for n in names if prefix + n in state_dict]
            if keys:
                error = self.write(i, state_dict[keys[0]], keys[0])
                for k in keys:
                    del state_dict[k]
                if error:
                    error_msgs.append(error)
                else:
                    self._loaded.update(prefix + n for n in names)
        self.runtime.reload_shards()

    @torch.no_grad()
    def write(self, i: int, value: torch.Tensor, key: str) -> str | None:
        """This rank's part of parameter ``i``'s full ``value`` into its shard (``reload_shards``
        after the last one); the error message of a shape mismatch instead."""
        layout = self.runtime.layout
        shape = layout.params[i].shape
        if value.shape != shape:
            return (
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the "
                f"shape in current model is {tuple(shape)}."
            )
        c = self.runtime.chunks[layout.param_chunk[i]]
        write_param(layout, c.shards, c.spec, layout.param_slot[i], value, self.runtime.coll.rank)
        return None

    def _load_post(self, _module: nn.Module, incompatible: _IncompatibleKeys) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._loaded]


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str) -> None:
    """``model.load_state_dict(safetensors.torch.load_file(path))``, one tensor at a time.

    Every rank reads only what it needs, when it needs it, so the host never holds the whole
    file per rank (docs/runtime.md). Strict as ``load_state_dict``: a missing weight, an unknown key or a wrong shape raises, naming them.
    """
    from safetensors import safe_open

    state = getattr(model, "_elixir", None)
    if state is None:
        raise ValueError("load_safetensors needs a model prepared by elixir_runtime.prepare")
    hooks, layout = state.model_state, state.runtime.layout
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = set(f.keys())
        missing, errors = [], []
        for i, names in enumerate(layout.names):
            key = next((n for n in names if n in keys), None)
            if key is None:
                missing.append(names[0])
                continue
            keys.difference_update(names)
            error = hooks.write(i, f.get_tensor(key), key)
            if error:
                errors.append(error)
        state.runtime.reload_shards()
        buffers = {n for n, _ in model.named_buffers()}
        rest = {k: f.get_tensor(k) for k in keys & buffers}  # buffers: small, through the module
    unexpected = sorted(keys - buffers)
    if rest:
        model.load_state_dict(rest, strict=False)
    if missing or unexpected or errors:
        raise RuntimeError(
            f"Error(s) in loading {path} into {type(model).__name__}: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}" + "".join(f"; {e}" for e in errors[:5])
        )
