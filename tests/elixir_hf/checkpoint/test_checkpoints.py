"""Checkpoints of ElixirTrainer: save -> resume continues bit-identically, the consolidated model
loads with ``from_pretrained`` (tied weights stored once) and gives the engine's logits, writes
leave no temporary files, and a checkpoint that cannot continue this run fails before training."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import transformers
from hf_cases import OFFLOAD_PLAN, VOCAB, history, make_trainer, training_args
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

import elixir_hf.trainer
from elixir_hf.checkpoint.format import MARKER_NAME, OPTIM_INDEX, CheckpointError
from elixir_hf.commands import convert
from helpers.models import ATTN_IMPL, make_batch

SAVE = dict(max_steps=10, save_strategy="steps", save_steps=5, eval_strategy="no")


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """A 10-step Elixir run with checkpoints at steps 5 and 10; returns (run dir, losses)."""
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer("gpt2", training_args(str(out), OFFLOAD_PLAN, **SAVE))
    trainer.train()
    return out, history(trainer, "loss")


def test_checkpoint_files(saved_run) -> None:
    ckpt = saved_run[0] / "checkpoint-5"
    names = {p.name for p in ckpt.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "optimizer-00000-of-00001.safetensors",
        "optimizer.safetensors.index.json",
        "scheduler.pt",
        "elixir_plan.json",
        "trainer_state.json",
        "rng_state.pth",
    } <= names
    assert "optimizer.pt" not in names
    assert not [n for n in names if n.startswith(".")], "temporary files left behind"
    plan = json.loads((ckpt / "elixir_plan.json").read_text())
    assert plan["world_size"] == 1 and plan["model"]["class"] == "GPT2LMHeadModel"
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    assert index["world_size"] == 1 and index["step"] == index["global_step"] == 5
    wte = index["params"]["transformer.wte.weight"]  # tied: once, under the name save_pretrained keeps
    assert wte["names"] == ["transformer.wte.weight", "lm_head.weight"] and "lm_head.weight" not in index["params"]
    assert wte["pieces"] == [["optimizer-00000-of-00001.safetensors", 0, VOCAB * 32]] and wte["step"] == 5
    with safe_open(str(ckpt / "optimizer-00000-of-00001.safetensors"), framework="pt") as f:
        assert f.get_tensor("transformer.wte.weight.master").shape == (VOCAB * 32,)
        weights = load_file(str(ckpt / "model.safetensors"))
        assert torch.equal(
            f.get_tensor("transformer.h.0.mlp.c_fc.weight.master"), weights["transformer.h.0.mlp.c_fc.weight"].flatten()
        )


def test_resume_gives_the_same_losses(saved_run, tmp_path) -> None:
    out, losses = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    resumed = make_trainer("gpt2", training_args(str(run), OFFLOAD_PLAN, **SAVE))
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-5"))
    assert history(resumed, "loss", after_step=5) == losses[5:]  # bit-identical on CPU/fp32


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_saved_model_loads_with_from_pretrained(tmp_path, model: str) -> None:
    trainer = make_trainer(model, training_args(str(tmp_path), OFFLOAD_PLAN, max_steps=3, eval_strategy="no"))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    with safe_open(str(tmp_path / "final" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    tied = trainer.model.config.tie_word_embeddings
    assert ("lm_head.weight" in keys) != tied, "a tied lm_head must be stored once, under the embedding's name"

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), attn_implementation=ATTN_IMPL).eval()
    if tied:
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    ids = make_batch(VOCAB)["input_ids"]
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not [p for p in (tmp_path / "final").iterdir() if p.name.startswith(".")]


def test_save_model_writes_the_plan_and_logs_the_final_folder(tmp_path) -> None:
    """The plan file lies beside the weights of ``save_model``'s output, not only in checkpoint-N/,
    and transformers' save messages name that folder, not the staging folder the files are written to."""
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "run"), OFFLOAD_PLAN, max_steps=1, eval_strategy="no"))
    trainer.train()
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(handler.format(record))
    tf_logger = logging.getLogger("transformers")
    tf_logger.addHandler(handler)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        trainer.save_model(str(tmp_path / "final"))
    finally:
        transformers.logging.set_verbosity(verbosity)
        tf_logger.removeHandler(handler)

    plan = json.loads((tmp_path / "final" / "elixir_plan.json").read_text())
    assert plan == {**json.loads(trainer.model._elixir.plan.to_json()), "model": plan["model"]}
    assert plan["model"]["class"] == "GPT2LMHeadModel" and plan["offload"]
    final = str(tmp_path / "final")
    assert any(m == f"Saving model checkpoint to {final}" for m in messages), messages
    assert any(final in m and "config.json" in m for m in messages), messages
    assert not [m for m in messages if ".elixir-save" in m], messages


def _resume(tmp_path: Path, saved: Path, model: str = "gpt2", **model_kwargs):
    trainer = make_trainer(model, training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **SAVE), **model_kwargs)
    return trainer.train(resume_from_checkpoint=str(saved))


@pytest.mark.parametrize("model, kwargs", [("gpt2", {"n_embd": 64}), ("llama", {})], ids=["wider-gpt2", "llama"])
def test_checkpoint_of_another_model_fails_clearly(saved_run, tmp_path, model: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="is from another model"):
        _resume(tmp_path, saved_run[0] / "checkpoint-5", model, **kwargs)


# ------------------------------------------------------------------ the optimizer index: bad input
def _edit_index(saved_run, tmp_path: Path, edit) -> Path:
    """A copy of checkpoint-5 whose optimizer index ``edit`` changed, the marker's sums updated."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-5", ckpt)
    path = ckpt / OPTIM_INDEX
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    marker["files"][OPTIM_INDEX] = {"bytes": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))
    return ckpt


BIAS = "transformer.h.0.attn.c_attn.bias"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda i: i["params"].pop(BIAS),
            rf"is partial: it has no optimizer state for 1 trainable parameter\(s\) \('{BIAS}'\)",
        ),
        (
            lambda i: i["params"][BIAS]["pieces"].clear(),
            rf"is partial: the pieces of '{BIAS}' cover its elements \[0, 0\) of 96",
        ),
        (
            lambda i: i["params"][BIAS].update(shape=[3, 32]),
            rf"is from another model: 1 parameter\(s\) differ in shape.*'{BIAS}' is \[3, 32\] there, \[96\] here",
        ),
        (
            lambda i: i.update(version=2),
            "has format version 2, newer than this elixir-hf reads \\(1\\): upgrade elixir-hf",
        ),
    ],
    ids=["parameter-missing", "piece-missing", "other-shape", "newer-format"],
)
def test_bad_optimizer_index_fails_before_training(saved_run, tmp_path, edit, message: str) -> None:
    ckpt = _edit_index(saved_run, tmp_path, edit)
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **SAVE))
    with pytest.raises(CheckpointError, match=message):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 5 and not history(trainer, "loss", after_step=5), "no step may run"


# ------------------------------------------------------------------ per-rank shards of versions before 0.1.0
@pytest.fixture
def legacy_checkpoint(saved_run, tmp_path) -> Path:
    """A checkpoint as versions before 0.1.0 wrote it: the optimizer state as one chunk shard per rank."""
    ckpt = tmp_path / "legacy"
    shutil.copytree(saved_run[0] / "checkpoint-5", ckpt)
    for f in [*ckpt.glob("optimizer-*.safetensors"), ckpt / OPTIM_INDEX]:
        f.unlink()
    torch.save({"format": "elixir-optimizer-shard/1", "rank": 0, "world_size": 1}, ckpt / "elixir_optim_rank0.pt")
    return ckpt


def _legacy_message(ckpt: Path) -> str:
    return (
        rf"{ckpt} holds the optimizer state as per-rank chunk shards \(elixir_optim_rank\{{r\}}.pt\).*"
        rf"pip install elixir-hf==0\.1\.0.*--elixir {ckpt}/elixir_plan.json, save a checkpoint"
    )


def test_shards_of_versions_before_0_1_0_are_refused_by_name(legacy_checkpoint, tmp_path) -> None:
    """Resume, ``--elixir off`` and elixir-convert each stop before a step, naming the version that reads them."""
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "new"), OFFLOAD_PLAN, **SAVE))
    with pytest.raises(CheckpointError, match=_legacy_message(legacy_checkpoint)):
        trainer.train(resume_from_checkpoint=str(legacy_checkpoint))
    assert not history(trainer, "loss"), "no step may run"
    data = make_trainer("gpt2", training_args(str(tmp_path / "ref"), **SAVE))  # the same model and data
    off = elixir_hf.trainer.ElixirTrainer(
        model=data.model,
        args=training_args(str(tmp_path / "off"), "off", **SAVE),
        train_dataset=data.train_dataset,
        data_collator=data.data_collator,
    )
    with pytest.raises(CheckpointError, match=_legacy_message(legacy_checkpoint)):
        off.train(resume_from_checkpoint=str(legacy_checkpoint))
    with pytest.raises(SystemExit, match="elixir-convert: " + _legacy_message(legacy_checkpoint)):
        convert.main([str(legacy_checkpoint), str(tmp_path / "plain")])


# ------------------------------------------------------------------ plain PyTorch checkpoints, in and out
def test_stock_trainer_checkpoint_resumes_in_elixir(tmp_path) -> None:
    """A stock Trainer's checkpoint (HF weights, a plain AdamW ``optimizer.pt``): Elixir continues as
    the stock Trainer does; the moments are mapped by optimizer order to the chunks."""
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE))
    stock.train()
    trainer = make_trainer("gpt2", training_args(str(tmp_path / "elixir"), OFFLOAD_PLAN, **SAVE))
    trainer.train(resume_from_checkpoint=str(tmp_path / "stock" / "checkpoint-5"))
    got, want = history(trainer, "loss", after_step=5), history(stock, "loss", after_step=5)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):  # with a fresh Adam state instead: 1e-3 to 1e-2 apart from step 7 on
        assert g == pytest.approx(w, rel=1e-5)


def test_convert_continues_in_a_plain_loop_and_back_in_elixir(saved_run, tmp_path) -> None:
    """``python -m elixir_hf.commands.convert checkpoint-5 OUT``: a plain PyTorch loop (AdamW from
    ``OUT/optimizer.pt``, the Trainer's schedule from ``OUT/scheduler.pt``, the Trainer's batches)
    takes the Elixir run's next 5 steps; and an Elixir run resumes from ``OUT`` as from checkpoint-5."""
    out, losses = saved_run
    plain = tmp_path / "plain"
    convert.main([str(out / "checkpoint-5"), str(plain)])
    model = AutoModelForCausalLM.from_pretrained(plain, attn_implementation=ATTN_IMPL).train()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    sd = torch.load(plain / "optimizer.pt", weights_only=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [params[i] for i in g["params"]]} for g in sd["param_groups"]])
    schedule = get_linear_schedule_with_warmup(opt, 0, SAVE["max_steps"])  # sets the lr: before the load
    opt.load_state_dict(sd)
    schedule.load_state_dict(torch.load(plain / "scheduler.pt", weights_only=True))
    args = training_args(str(tmp_path / "data"), **SAVE)
    micro = list(itertools.islice(make_trainer("gpt2", args).get_train_dataloader(), 20))[10:]  # steps 6-10
    got = []
    for step in range(5):
        pair = micro[2 * step : 2 * step + 2]
        items = sum((b["labels"] != -100).sum() for b in pair)  # the Trainer's loss: a sum over the step's labels
        total = 0.0
        for batch in pair:
            loss = model(**batch, num_items_in_batch=items).loss
            loss.backward()
            total += loss.item()
        got.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        schedule.step()
        opt.zero_grad()
    want = load_file(str(out / "checkpoint-10" / "model.safetensors"))
    final = model.state_dict()
    # measured 6e-8 (the plain and the Elixir Adam kernels' rounding); a step with the lr the schedule
    # had at construction instead of the loaded one: 6e-3
    assert max((final[k] - w).abs().max().item() for k, w in want.items()) < 1e-6
    for g, w in zip(got, losses[5:]):
        assert g == pytest.approx(w, rel=1e-5)

    back = make_trainer("gpt2", training_args(str(tmp_path / "back"), OFFLOAD_PLAN, **SAVE))
    back.train(resume_from_checkpoint=str(plain))
    assert history(back, "loss", after_step=5) == pytest.approx(losses[5:], rel=1e-6)


def test_stock_trainer_resumes_from_converted(saved_run, tmp_path) -> None:
    """``OUT`` of ``elixir-convert`` is a stock Trainer checkpoint too (weights, ``optimizer.pt``,
    scheduler, trainer state, RNG): the stock Trainer takes the Elixir run's next 5 steps."""
    out, losses = saved_run
    plain = tmp_path / "plain"
    convert.main([str(out / "checkpoint-5"), str(plain)])
    stock = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE))
    stock.train(resume_from_checkpoint=str(plain))
    assert history(stock, "loss", after_step=5) == pytest.approx(losses[5:], rel=1e-5)


def test_incomplete_checkpoint_fails_clearly(saved_run, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "checkpoint-5", ckpt)
    (ckpt / "scheduler.pt").unlink()
    with pytest.raises(ValueError, match="scheduler.pt is missing"):
        _resume(tmp_path, ckpt)


def test_a_mistyped_resume_path_gets_the_stock_trainers_message(tmp_path) -> None:
    missing = tmp_path / "checkpoint-9"  # never written
    for elixir in (None, OFFLOAD_PLAN):  # the same words with and without Elixir
        trainer = make_trainer("gpt2", training_args(str(tmp_path / "out"), elixir, max_steps=1))
        with pytest.raises(ValueError, match=f"^Can't find a valid checkpoint at {missing}$"):
            trainer.train(resume_from_checkpoint=str(missing))


def test_elixir_off_resumes_an_elixir_checkpoint_with_its_adam_state(saved_run, tmp_path) -> None:
    """``--elixir off`` (``ElixirTrainer``, as elixir-run builds it, with Elixir off) resuming an Elixir
    checkpoint: the stock path would find no ``optimizer.pt`` and restart AdamW and the schedule in
    silence; here the run continues as the Elixir run did (its fp32 masters, Adam state and schedule)."""
    out, losses = saved_run
    args = training_args(str(tmp_path / "off"), "off", **SAVE)
    assert args.elixir_plugin is None
    data = make_trainer("gpt2", training_args(str(tmp_path / "ref"), **SAVE))  # the same model and data
    off = elixir_hf.trainer.ElixirTrainer(
        model=data.model, args=args, train_dataset=data.train_dataset, data_collator=data.data_collator
    )
    off.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    assert not hasattr(off.model, "_elixir")  # the stock Trainer's run
    assert history(off, "loss", after_step=5) == pytest.approx(losses[5:], rel=1e-5)  # a restarted schedule: not
    restarted = make_trainer("gpt2", training_args(str(tmp_path / "stock"), **SAVE))
    restarted.train(resume_from_checkpoint=str(out / "checkpoint-5"))  # the stock Trainer: Adam restarts
    assert history(restarted, "loss", after_step=5) != pytest.approx(losses[5:], rel=1e-5)
