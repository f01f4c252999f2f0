"""``patches.mask_decisions_of``: the planner's fake-tensor profile traces the attention the run runs.
For each kind of batch, the attention FLOPs the profile prices (``costs``, one rule for both) equal
those of the SDPA ops a real step dispatches: no mask, an all-ones mask (``is_causal`` replaces it),
a padded batch and packed sequences (the mask stays)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_hf.patches import mask_decisions_of
from elixir_runtime.hardware import costs
from elixir_runtime.profiler import profile_model
from helpers.models import tiny_llama

BATCH, SEQ, VOCAB = 2, 32, 128


class _AttentionFlops(TorchDispatchMode):
    """Sums the attention FLOPs of the SDPA ops a real step dispatches, as the profile counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        counted = costs.op_cost(func, args, kwargs or {}, [], [])
        if counted[1].startswith("attention"):
            self.flops += counted[0]
        return func(*args, **(kwargs or {}))


def _batch(kind: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if kind == "ones":
        batch["attention_mask"] = torch.ones_like(ids)
    elif kind == "padded":
        batch["attention_mask"] = (torch.arange(SEQ) < SEQ - 5).long().expand(BATCH, SEQ).clone()
    elif kind == "packed":  # two sequences a row
        batch["position_ids"] = torch.cat([torch.arange(SEQ // 2)] * 2).expand(BATCH, SEQ).clone()
    return batch


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    with _AttentionFlops() as mode:
        model(**batch).loss.backward()
    return mode.flops


def _profiled(model: torch.nn.Module, batch: dict[str, torch.Tensor], decided: bool) -> int:
    with mask_decisions_of(batch) if decided else contextlib.nullcontext():
        profile = profile_model(model, batch, dtype=torch.float32, device="cpu")
    return sum(f for cost in profile.compute.values() for cls, f in cost.flops.items() if cls.startswith("attention"))


def _model() -> torch.nn.Module:
    model = tiny_llama(n_embd=64, n_head=2)
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize("kind", ["none", "ones", "padded", "packed"])
def test_the_profile_prices_the_attention_the_run_runs(kind: str) -> None:
    model, batch = _model(), _batch(kind)
    run = _run(model, batch)
    assert run > 0
    assert _profiled(model, batch, decided=True) == run


def test_without_the_decisions_an_unpadded_batch_is_priced_twice() -> None:
    """Why the patch exists: on fake tensors transformers keeps the full mask (its answer for values it
    cannot read), and SDPA then computes both triangles. If this fails, transformers decides on fake
    tensors as on real ones, and the patch can go."""
    model, batch = _model(), _batch("ones")
    assert _profiled(model, batch, decided=False) == 2 * _run(model, batch)


def test_a_batch_without_values_changes_nothing() -> None:
    """A meta batch (``elixir-plan``'s has only ``input_ids`` and ``labels``, which decide nothing):
    transformers' own functions stay in place."""
    from transformers import masking_utils

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    before = masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices
    with mask_decisions_of({"input_ids": ids, "attention_mask": ids}):
        assert (masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices) == before
    with mask_decisions_of({"input_ids": ids}):
        assert masking_utils._ignore_causal_mask_sdpa is not before[0]
    assert (masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices) == before
