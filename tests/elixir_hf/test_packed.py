"""Padding-free batches (``DataCollatorWithFlattening``: one row of the batch's examples end to end, their
``position_ids`` restarting at each): the Trainer's plan covers the packed length, and the run trains as the
stock Trainer does on the same packed batches."""

from __future__ import annotations

import pytest
import torch
from hf_cases import VOCAB, history, training_args
from transformers import DataCollatorWithFlattening, Trainer

from elixir_hf import ElixirTrainer
from helpers.models import tiny_llama

BATCH = 4


class Examples(torch.utils.data.Dataset):
    """Examples of 24 to 96 tokens, the longest 96."""

    def __init__(self, n: int = 32) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = [24 + (i * 37) % 73 for i in range(n - 1)] + [96]
        self.ids = [torch.randint(3, VOCAB, (n_,), generator=gen).tolist() for n_ in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, elixir: str | None) -> Trainer:
    model = tiny_llama(seed=0, vocab=VOCAB, n_positions=1024)
    args = training_args(
        str(tmp_path), elixir=elixir, max_steps=6, per_device_train_batch_size=BATCH, eval_strategy="no"
    )
    cls = Trainer if elixir is None else ElixirTrainer
    return cls(model=model, args=args, train_dataset=Examples(), data_collator=DataCollatorWithFlattening())


@pytest.mark.parametrize("elixir", ['{"mode": "static", "n_blocks": "min", "offload": 0.5}', "auto"])
def test_packed_batches_are_planned_for_and_train_as_the_stock_trainer(tmp_path, elixir: str) -> None:
    stock = _trainer(tmp_path / "stock", None)
    stock.train()
    packed = _trainer(tmp_path / "elixir", elixir)
    packed.train()
    plan = packed.model._elixir.plan
    assert plan.batch_shape == (1, BATCH * 96)  # one packed row: the longest example, batch times
    assert history(packed, "loss") == pytest.approx(history(stock, "loss"), rel=1e-4)
