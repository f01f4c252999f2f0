"""Plans for the longest batch the run will see (``elixir_hf/batch_plan.py``) and the warning when a
training batch is larger than the plan's (``elixir_runtime/runtime/batch_guard.py``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hf_cases import OFFLOAD_PLAN, VOCAB, make_trainer, training_args

import elixir_runtime as er
from elixir_hf.batch_plan import SAMPLE, planned_batch, planned_length
from elixir_hf.commands.plan import main
from helpers.models import PAD_ID, tiny_llama


class VariableLengths(torch.utils.data.Dataset):
    """The first ``short`` examples 8 tokens long, the rest 32: a plan from the first batch is too small."""

    def __init__(self, n: int = 40, short: int = 4, long: int = 32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(3, VOCAB, (8 if i < short else long,), generator=gen) for i in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def pad(items: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the longest in the batch: ``PAD_ID`` ids, 0 mask, -100 labels."""
    n = max(len(x["input_ids"]) for x in items)
    out = {}
    for key, fill in (("input_ids", PAD_ID), ("attention_mask", 0), ("labels", -100)):
        rows = [torch.as_tensor(x[key]) for x in items]
        out[key] = torch.stack([torch.cat([r, r.new_full((n - len(r),), fill)]) for r in rows])
    return out


def test_the_length_planned_for() -> None:
    assert planned_length(32, True, None, None) == 32  # the longest example
    assert planned_length(32, True, 24, None) == 24  # batches are cut to the stated length
    assert planned_length(32, True, 64, None) == 32  # every example seen: none reaches the stated length
    assert planned_length(20, False, 64, None) == 64  # a sample: a later example may be that long
    assert planned_length(32, True, None, 16) == 16  # the model takes no more
    assert planned_length(20, False, None, 2048) == 20


def test_the_trainer_plans_for_the_long_examples_and_warns_once_beyond(tmp_path, caplog) -> None:
    """First examples short, later ones long: the plan's batch_shape is the long one; a batch beyond
    it warns once, naming both shapes and the fix; batches within it and evaluation do not."""
    trainer = make_trainer("llama", training_args(str(tmp_path), elixir=OFFLOAD_PLAN, max_steps=2, eval_strategy="no"))
    trainer.train_dataset, trainer.data_collator = VariableLengths(), pad
    trainer.create_optimizer()
    model = trainer.model
    assert model._elixir.plan.batch_shape == (2, 32)
    with caplog.at_level(logging.WARNING, logger="elixir_runtime"):
        trainer.train()  # every batch within the plan
        assert not [r for r in caplog.records if "batch_shape" in r.getMessage()]
        model.train()
        longer = pad([VariableLengths(n=2, short=0, long=48)[i] for i in range(2)])
        for _ in range(2):
            model(**longer).loss.backward()
            trainer.optimizer.zero_grad()
        with torch.no_grad():
            model.eval()
            model(**pad([VariableLengths(n=4, short=0, long=48)[i] for i in range(4)]))
    warned = [r.getMessage() for r in caplog.records if "batch_shape" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "2 x 48 = 96 tokens" in warned[0] and "2 x 32 = 64" in warned[0]
    assert "max_length" in warned[0] and "--elixir plan.json" in warned[0]


def test_a_datasets_column_is_scanned_whole_with_its_selection() -> None:
    """A ``datasets.Dataset`` is scanned from its Arrow offsets, its shuffle/selection applied: the
    longest example left out of the selection does not count; every other one does."""
    datasets = pytest.importorskip("datasets")
    lengths = [8] * (SAMPLE + 200)
    lengths[-1], lengths[SAMPLE + 7] = 60, 40  # the first never in the selection
    ds = datasets.Dataset.from_dict(
        {key: [[1] * n for n in lengths] for key in ("input_ids", "attention_mask", "labels")}
    )
    ds = ds.select(range(len(lengths) - 1)).shuffle(seed=0)
    batch = planned_batch(ds, pad, 3, model=tiny_llama(n_positions=64))
    assert batch["input_ids"].shape == (3, 40) and batch["attention_mask"].all()
    assert planned_batch(ds, pad, 3, model=tiny_llama(n_positions=32))["input_ids"].shape == (3, 32)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def test_a_sample_plans_for_the_stated_length_and_stretches_the_longest_example() -> None:
    class Args:
        max_length = 24

    batch = planned_batch(Stream(VariableLengths(n=12, short=12)), pad, 2, args=Args())  # all 8 tokens long
    ids = batch["input_ids"]
    assert ids.shape == (2, 8)  # fewer than SAMPLE examples: every one seen, none reaches 24
    assert torch.equal(batch["labels"], ids) and batch["attention_mask"].all()
    batch = planned_batch(Stream(VariableLengths(n=SAMPLE + 1, short=SAMPLE + 1)), pad, 2, args=Args())
    ids = batch["input_ids"]
    assert ids.shape == (2, 24) and torch.equal(ids[0, 8:16], ids[0, :8])  # the example repeated to length


def test_elixir_plan_records_the_batch_shape(capsys, tmp_path) -> None:
    config = tmp_path / "config.json"
    tiny_llama().config.to_json_file(config)
    code = main(["--model", str(config), "--seq-len", "48", "--batch-size", "3", "--hardware", "h100", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["plan"]["batch_shape"] == [3, 48]
    old = json.loads(out)["plan"]
    del old["batch_shape"]
    assert er.ElixirPlan.from_dict(old).batch_shape is None  # plan files from before it was recorded
