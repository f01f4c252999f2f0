"""An Elixir checkpoint as a plain PyTorch one (``elixir-convert CHECKPOINT OUT``,
``commands/convert.py``), to continue the run without Elixir (a plain loop, DDP, FSDP, the stock Trainer).

``OUT`` gets the model in fp32 from the fp32 master weights (``save_pretrained``: config and
safetensors weights, ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it), ``optimizer.pt``: a
``torch.optim.AdamW`` ``state_dict()`` whose parameters are numbered in ``model.parameters()``
order, with the run's param groups (hyperparameters, ``lr`` as the scheduler last set it) and every
trainable parameter's step, ``exp_avg`` and ``exp_avg_sq`` in fp32 (8-bit moments dequantized; step 0 for one that never had a gradient), and the checkpoint's other files (scheduler,
Trainer state, RNG states, tokenizer). It is what the stock Trainer writes, so it resumes there, and
Elixir resumes from it too. Rebuild the optimizer with the saved groups::

    sd = torch.load(f"{OUT}/optimizer.pt", weights_only=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [params[i] for i in g["params"]]} for g in sd["param_groups"]])
    opt.load_state_dict(sd)

Runs offline on one process: the checkpoint's marker and sums are checked first, and the whole
model is held in host memory once (as DeepSpeed's ``zero_to_fp32`` does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elixir_runtime import ParamEntry, StateTensor, decode_state, saved_state

from .format import (
    MARKER_NAME,
    NOTE_NAME,
    OPTIM_INDEX,
    PLAN_NAME,
    CheckpointError,
    optimizer_format,
    read_marker,
    verify,
)
from .optimizer_files import read_optimizer_index

__all__ = ["convert", "torch_adam_state"]

logger = logging.getLogger(__name__)

_NOT_COPIED = re.compile(
    rf"^({re.escape(MARKER_NAME)}|{re.escape(PLAN_NAME)}|{re.escape(OPTIM_INDEX)}|{re.escape(NOTE_NAME)}|optimizer-.*\.safetensors"
    r"|model.*\.safetensors(\.index\.json)?|config\.json|generation_config\.json)$"
)
"""Elixir's files and what ``save_pretrained`` writes anew."""


def convert(
    checkpoint: str | Path, out: str | Path, config: str | Path | None = None, *, overwrite: bool = False
) -> None:
    """``config``: where the model's ``config.json`` is when the checkpoint has none (Accelerate's
    ``save_state`` writes only the weights): a model folder or name. ``out`` may not be the checkpoint
    (or inside it), nor a folder with files unless ``overwrite``. A file of the checkpoint that is a
    symbolic link is copied as the link, not its target's contents (logged)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, out = Path(checkpoint), Path(out)
    _check_target(ckpt, out, overwrite)
    fmt = optimizer_format(ckpt)
    if fmt != "named":
        raise CheckpointError(
            f"{ckpt} holds no optimizer state by parameter name ({OPTIM_INDEX})"
            + (": it is a plain PyTorch checkpoint already" if fmt == "plain" else "")
        )
    if config is None and not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{ckpt} has no config.json (a save_state folder?): pass the model's with --config")
    verify(ckpt, 0, True)
    conf = AutoConfig.from_pretrained(config if config is not None else ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, config=conf, dtype=torch.float32)
    position = {id(p): i for i, p in enumerate(model.parameters())}
    state, groups = torch_adam_state(ckpt, model, lambda g: [position[id(p)] for p in g])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    torch.save({"state": state, "param_groups": groups}, out / "optimizer.pt")
    for f in ckpt.iterdir():
        if f.is_symlink() and not _NOT_COPIED.match(f.name):
            logger.warning("elixir-convert: %s is a symbolic link (to %s): copied as the link", f, os.readlink(f))
            (out / f.name).unlink(missing_ok=True)
            shutil.copy2(f, out / f.name, follow_symlinks=False)
        elif f.is_file() and not _NOT_COPIED.match(f.name):
            shutil.copy2(f, out / f.name)


def _check_target(ckpt: Path, out: Path, overwrite: bool) -> None:
    source, target = ckpt.resolve(), out.resolve()
    if target == source or source in target.parents:
        raise CheckpointError(
            f"OUT {out} is the checkpoint {ckpt} (or inside it): the plain checkpoint goes to a folder of its own"
        )
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"OUT {out} exists and holds files: give a new folder, or --overwrite to write into it")


def torch_adam_state(
    ckpt: Path, model: torch.nn.Module, numbering: Callable[[list[torch.nn.Parameter]], list[int]]
) -> tuple[dict[int, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """A verified Elixir checkpoint's optimizer state as a ``torch.optim.AdamW`` ``state_dict``'s
    ``state`` and ``param_groups`` for ``model``, whose parameters get the fp32 master weights.
    ``numbering(params)``: the state-dict positions of a group's parameters. Refuses a parameter of
    the checkpoint ``model`` lacks, or a shape that differs; a parameter ``numbering`` leaves out (frozen
    in this run: not in its optimizer) gets its weights and no state, logged."""
    marker = read_marker(ckpt)
    if marker is None:
        raise CheckpointError(f"{ckpt} has no {MARKER_NAME}: not a complete Elixir checkpoint")
    index = read_optimizer_index(ckpt, marker["step"])
    by_name = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    frozen = []
    files = {p[0] for e in index["params"].values() for p in e["pieces"]}
    with contextlib.ExitStack() as stack:
        opened: dict[str, safe_open] = {
            f: stack.enter_context(safe_open(str(ckpt / f), framework="pt")) for f in sorted(files)
        }
        for name, entry in index["params"].items():
            param = next((by_name[n] for n in entry["names"] if n in by_name), None)
            if param is None or list(param.shape) != entry["shape"]:
                raise CheckpointError(
                    f"{ckpt / OPTIM_INDEX}: parameter {name!r} {entry['shape']} is not in {ckpt}'s model"
                )
            stored = {t.kind: _gather(opened, name, t, entry, param.numel()) for t in saved_state(index).tensors}
            full = {k: v.view(param.shape) for k, v in decode_state(saved_state(index), stored).items()}
            with torch.no_grad():
                param.copy_(full.pop("master"))
            # every parameter, one that never had a gradient at step 0 (torch would keep none): a loader
            # then tells such a parameter from lost state (optimizer_files.load_optimizer)
            numbers = numbering([param])
            if not numbers:
                frozen.append(name)
                continue
            state[numbers[0]] = {"step": torch.tensor(float(entry["step"])), **full}
    if frozen:
        logger.warning(
            "elixir: %d parameter(s) with Adam state in %s are not trained by this run's optimizer (frozen: %s): "
            "their weights are loaded, their Adam state left out",
            len(frozen),
            ckpt,
            ", ".join(frozen[:5]) + (", ..." if len(frozen) > 5 else ""),
        )
    groups = []
    for g in index["param_groups"]:
        hypers = {k: tuple(v) if k == "betas" else v for k, v in g.items() if k != "params"}
        groups.append({**hypers, "params": numbering([by_name[n] for n in g["params"] if n in by_name])})
    return state, groups


def _gather(opened: dict[str, safe_open], name: str, t: StateTensor, entry: ParamEntry, numel: int) -> torch.Tensor:
    """The whole of ``name``'s state tensor ``t`` (flat: an entry per ``t.per`` elements) from its pieces."""
    flat = torch.empty(t.entries(numel), dtype=t.dtype)
    for file, start, end in entry["pieces"]:
        flat[t.span(start, end)] = opened[file].get_tensor(f"{name}.{t.kind}")
    return flat
