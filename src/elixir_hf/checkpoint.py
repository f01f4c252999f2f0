"""Checkpoint files of an Elixir run and the checks that make a bad resume fail early.

Layout of a checkpoint folder (on top of what the Trainer writes):

* ``model.safetensors`` (+ config): consolidated, loadable by ``from_pretrained``;
* ``elixir_optim_rank{r}.pt``: rank ``r``'s optimizer shard (master weights, Adam moments,
  loss scale), written by every rank;
* ``elixir_plan.json``: the plan the run used (see ``plugin.py`` for reusing it).

Every file is written to a temporary name and moved into place with ``os.replace``, so a crash
leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn

__all__ = [
    "PLAN_NAME",
    "shard_name",
    "atomic_torch_save",
    "atomic_write_text",
    "staged_dir",
    "saved_world_size",
    "check_resume",
    "load_shard",
]

PLAN_NAME = "elixir_plan.json"
_SHARD_RE = re.compile(r"^elixir_optim_rank(\d+)\.pt$")


def shard_name(rank: int) -> str:
    return f"elixir_optim_rank{rank}.pt"


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def staged_dir(output_dir: str | os.PathLike) -> Iterator[str]:
    """Yields a fresh folder next to ``output_dir``; on success its files replace those in it.

    Weight files of an earlier save that the new save does not write (another shard count) are
    removed, so ``from_pretrained`` never mixes two saves.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".elixir-save-", dir=out))
    try:
        yield str(stage)
        new = {p.name for p in stage.iterdir()}
        for old in out.glob("model*.safetensors*"):
            if old.name not in new:
                old.unlink()
        for item in stage.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def saved_world_size(checkpoint: str | os.PathLike) -> int | None:
    """Number of ranks that wrote optimizer shards into ``checkpoint`` (``None``: no shards)."""
    plan = Path(checkpoint) / PLAN_NAME
    if plan.is_file():
        return int(json.loads(plan.read_text())["world_size"])
    ranks = [int(m.group(1)) for p in Path(checkpoint).iterdir() if (m := _SHARD_RE.match(p.name))]
    return max(ranks) + 1 if ranks else None


def check_resume(checkpoint: str | os.PathLike, model: nn.Module, world_size: int) -> None:
    """Fails before any weight is loaded when the checkpoint cannot continue this run."""
    ckpt = Path(checkpoint)
    saved = saved_world_size(ckpt)
    if saved is not None and saved != world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {saved} rank(s) (one optimizer shard each) and this run has "
            f"{world_size}: resume with {saved} processes (torchrun --nproc_per_node {saved} / accelerate launch "
            f"--num_processes {saved}), or start a new run from its weights with --model_name_or_path {ckpt}"
        )
    if saved is None and (ckpt / "optimizer.pt").is_file():
        raise ValueError(
            f"checkpoint {ckpt} holds a plain PyTorch optimizer state (optimizer.pt), not Elixir shards: resume it "
            f"with --elixir off, or start an Elixir run from its weights with --model_name_or_path {ckpt}"
        )
    _check_weights_match(ckpt, model)


def _check_weights_match(ckpt: Path, model: nn.Module) -> None:
    shapes = _checkpoint_shapes(ckpt)
    if shapes is None:
        return
    mismatched, missing = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in shapes:
            seen.add(id(p))
            if list(shapes[name]) != list(p.shape):
                mismatched.append(f"{name!r} is {list(shapes[name])} there, {list(p.shape)} here")
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:  # a tied weight counts as present under any of its names
            missing.append(name)
            seen.add(id(p))
    if mismatched or missing:
        examples = mismatched[:2] + [f"{n!r} is missing" for n in missing[:2]]
        raise ValueError(
            f"checkpoint {ckpt} is from another model: {len(mismatched)} weight(s) differ in shape and "
            f"{len(missing)} are missing ({'; '.join(examples)}). Resume with the model it was saved from, or "
            "start a new run"
        )


def _checkpoint_shapes(ckpt: Path) -> dict[str, list[int]] | None:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as st:
            for key in st.keys():
                shapes[key] = st.get_slice(key).get_shape()
    return shapes


def load_shard(checkpoint: str | os.PathLike, rank: int) -> dict[str, Any] | None:
    path = Path(checkpoint) / shard_name(rank)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
