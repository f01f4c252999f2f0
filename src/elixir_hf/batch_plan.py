"""The batch the plan is made for: the largest ``(batch, seq)`` the run can know before it starts.

[Note: the planned batch shape]
The planner budgets the activations of the one batch it profiles, so that batch must be as long as
any the run will see. Its batch is the per-device batch size; its length, in this order:

* the longest example of the training set, by a scan: the whole ``input_ids`` column of a
  ``datasets.Dataset`` (list lengths read from Arrow's offsets, no example decoded), else a sample
  of at most ``SAMPLE`` examples (evenly spread over a sized dataset; the first ones of an
  iterable one);
* cut to the length the run states, where it states one (``max_length`` / ``max_seq_length`` of
  the arguments, TRL's ``SFTConfig``): batches are cut to it, so it is an upper bound; where the
  scan saw only a sample, the stated length itself (a later example may be that long);
* capped by the model's ``max_position_embeddings``: longer inputs fail in the model anyway.

Not the model's ``max_position_embeddings`` alone where nothing is stated: 131072 for Llama-3.1
would plan every run for sequences its data never has. A run_clm-style dataset, grouped into
``block_size`` blocks beforehand, is found by the scan. The batch itself is the longest example,
its per-token fields (``input_ids``, ``labels``, ``attention_mask``, ...) repeated to the planned
length, ``batch`` times, through the run's own collator, so padding and labels follow its
conventions. Anything else (no ``input_ids``, a collator that rejects it): the first batch, as
before. A batch the plan did not foresee runs where the plan's budget provably holds it, else is
refused before its forward (``elixir_runtime/runtime/batch_guard.py``).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .engine import example_batch

__all__ = ["SAMPLE", "planned_batch", "planned_length"]

logger = logging.getLogger(__name__)

SAMPLE = 512
"""Examples a scan reads where it cannot read the lengths of all of them."""


@dataclass(frozen=True)
class _Longest:
    example: Mapping[str, object]
    length: int
    complete: bool
    """Every example's length was seen."""


def planned_batch(
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any] | None,
    batch_size: int,
    *,
    args: object = None,
    model: object = None,
) -> object:
    """The example batch the plan is made with (the Note above); ``args``: the training arguments
    (their stated length), ``model``: the model (its ``max_position_embeddings``)."""
    try:
        longest = _longest(dataset)
        seq = planned_length(longest.length, longest.complete, _stated_length(args), _max_positions(model))
        items = [_stretched(longest.example, seq)] * batch_size
        batch = collate_fn(items) if collate_fn is not None else torch.utils.data.default_collate(items)
    except Exception as exc:  # no input_ids, an unknown dataset or collator: the first batch, as before
        logger.info(
            "elixir: no scan of the example lengths (%s: %s); the plan is made for the first batch",
            type(exc).__name__,
            exc,
        )
        return example_batch(dataset, collate_fn, batch_size)
    logger.info(
        "elixir: planning for batches of %d x %d tokens (longest example %d tokens%s)",
        batch_size,
        seq,
        longest.length,
        "" if longest.complete else f", of a sample of {SAMPLE}",
    )
    return batch


def planned_length(longest: int, complete: bool, stated: int | None, max_positions: int | None) -> int:
    """The sequence length to plan for (the Note above)."""
    seq = longest
    if stated:
        seq = min(stated, longest) if complete else stated
    return min(seq, max_positions) if max_positions else seq


def _longest(dataset: Any) -> _Longest:
    lengths = _arrow_lengths(dataset)
    if lengths is not None:
        i = int(np.argmax(lengths))
        return _Longest(dataset[i], int(lengths[i]), True)
    if hasattr(dataset, "__len__") and not isinstance(dataset, torch.utils.data.IterableDataset):
        n = len(dataset)
        indices = range(n) if n <= SAMPLE else np.linspace(0, n - 1, SAMPLE).astype(int).tolist()
        items = [dataset[i] for i in indices]
        complete = n <= SAMPLE
    else:
        items = list(itertools.islice(dataset, SAMPLE))
        complete = len(items) < SAMPLE
    example = max(items, key=_length)
    return _Longest(example, _length(example), complete)


def _arrow_lengths(dataset: Any) -> np.ndarray | None:
    """Every example's ``input_ids`` length from a ``datasets.Dataset``'s Arrow offsets (its
    selection or shuffle applied); ``None`` for any other dataset."""
    try:
        import datasets
        import pyarrow.compute as pc
    except ImportError:
        return None
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names or not len(dataset):
        return None
    lengths = pc.list_value_length(dataset.data.column("input_ids"))
    if dataset._indices is not None:
        lengths = pc.take(lengths, dataset._indices.column(0))
    out: np.ndarray = lengths.to_numpy(zero_copy_only=False)  # pyarrow ships no types
    return out


def _length(example: object) -> int:
    if not isinstance(example, Mapping) or "input_ids" not in example:
        raise TypeError(f"examples without input_ids ({type(example).__name__})")
    return len(example["input_ids"])


def _stretched(example: Mapping[str, object], seq: int) -> dict[str, object]:
    """``example`` with its per-token fields (those as long as ``input_ids``) repeated or cut to ``seq``."""
    n = _length(example)
    if n == 0:
        raise ValueError("the longest example is empty")
    reps = math.ceil(seq / n)
    out: dict[str, object] = {}
    for key, value in example.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and len(value) == n:
            out[key] = value.repeat(reps)[:seq]
        elif isinstance(value, list) and len(value) == n:
            out[key] = (value * reps)[:seq]
        else:
            out[key] = value
    return out


def _stated_length(args: object) -> int | None:
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _max_positions(model: object) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None
