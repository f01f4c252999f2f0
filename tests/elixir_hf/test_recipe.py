"""The GPT-2 recipe end to end on CPU, offline: its defaults (tiny model, stdlib corpus, locally
trained tokenizer, --elixir auto), shortened to a few steps and a quarter of the CPU corpus. It must print the plan, lower the
loss, report perplexity and leave a model that ``from_pretrained`` loads, with its plan. Its
``datasets`` pipeline (run_clm's cached tokenize and group maps, streaming, .txt line breaks)
and local Llama / Qwen2 folders through ``--model_name_or_path`` are run in-process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, default_data_collator

from elixir_hf.engine import example_batch

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt2"
TRAIN = RECIPE / "train.py"


@pytest.fixture()
def recipe(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The recipe's modules, importable, with their caches in ``tmp_path``."""
    monkeypatch.syspath_prepend(str(RECIPE))
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path / "elixir-cache"))
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)
    import data
    import train

    return SimpleNamespace(data=data, train=train)


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
def test_default_recipe_trains_offline(tmp_path, hardware_in) -> None:
    out = tmp_path / "run"
    hardware_in(tmp_path / "cache")
    env = {
        **os.environ,
        "ELIXIR_CACHE_DIR": str(tmp_path / "cache"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("ELIXIR_CONFIG", None)
    env.pop("CI", None)  # CI=1: transformers' records (Elixir's too) also reach the recipe's basicConfig handler
    args = [
        "--output_dir",
        str(out),
        "--max_steps",
        "16",
        "--logging_steps",
        "4",
        "--eval_steps",
        "8",
        "--max_eval_samples",
        "16",
        "--disable_tqdm",
        "true",
        "--corpus_mb",
        "0.5",
    ]  # 16 steps need 0.1 MB
    proc = subprocess.run([sys.executable, str(TRAIN), *args], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]

    assert (
        proc.stderr.count("Elixir plan for GPT2LMHeadModel") == 1 and "gathered-parameter cache" in proc.stderr
    )  # --log_level info
    assert "elixir/" not in proc.stdout and "s/step" in proc.stdout  # the console line stays short
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    assert all("elixir/step_s" in h for h in history if "loss" in h)
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    assert len(evals) == 2 and evals[1] < evals[0], evals  # at steps 8 and 16
    assert json.loads((out / "eval_results.json").read_text())["eval_perplexity"] < 2048  # uniform guess: 2048
    _matches_the_pin(tmp_path / "cache", losses, evals)
    assert (out / "checkpoint-16" / "elixir_plan.json").is_file()
    plan = json.loads((out / "elixir_plan.json").read_text())  # beside the final weights too
    assert plan["model"]["class"] == "GPT2LMHeadModel"

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("def read(self, size=-1):\n    return self._buffer[:size]", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def _matches_the_pin(cache: Path, losses: list[float], evals: list[float]) -> None:
    """On the corpus ``expected_losses.json`` pins (this Python's standard library made into the same
    0.5 MB), the run's losses are the pinned ones: a change to the corpus, the tokenizer, the recipe's
    defaults or the training shows here, and in the losses recipes/README.md quotes."""
    expected = json.loads((RECIPE / "expected_losses.json").read_text())
    (corpus,) = (cache / "corpus").glob("stdlib-*-0.5mb.jsonl")
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
    if digest != expected["corpus_sha256"]["0.5"]:
        pytest.skip(f"the losses are pinned for another corpus ({corpus.name}, sha256 {digest[:12]}: another stdlib)")
    pinned = expected["short_run"]
    assert losses == pytest.approx(pinned["loss"], abs=2e-3) and evals == pytest.approx(pinned["eval_loss"], abs=2e-3)


def _data_args(**overrides) -> SimpleNamespace:
    args = dict(
        dataset_name=None,
        dataset_config_name=None,
        train_file=None,
        validation_file=None,
        validation_split_percentage=5,
        streaming=False,
        keep_linebreaks=True,
        corpus_mb=0.1,
    )
    return SimpleNamespace(**{**args, **overrides})


def test_datasets_pipeline_cached_grouped_and_streamed(recipe, tmp_path) -> None:
    """run_clm's maps: documents + EOS joined and cut into blocks; a second run reads the cache
    (no file rewritten), ``overwrite_cache`` redoes it; streaming gives the same blocks, and the
    engine's example batch of the stream is its first blocks."""
    data, cache = recipe.data, str(tmp_path / "datasets")
    raw = data.load_raw(_data_args(), cache)
    texts = list(raw["train"]["text"])
    total = len(texts) + len(raw["validation"])
    assert len(raw["validation"]) == (total + 19) // 20 and len(texts) >= 3  # every 20th document held out
    tokenizer = data.train_tokenizer(data.training_texts(raw, False), 300, 32)
    blocks = data.lm_datasets(raw, tokenizer, 32)
    ids = [t for text in texts[:3] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert blocks["train"][0]["input_ids"] == blocks["train"][0]["labels"] == ids[:32]
    assert blocks["train"][1]["input_ids"] == ids[32:64]

    files = {f["filename"]: os.stat(f["filename"]).st_mtime_ns for f in blocks["train"].cache_files}
    again = data.lm_datasets(data.load_raw(_data_args(), cache), tokenizer, 32)
    assert {f["filename"]: os.stat(f["filename"]).st_mtime_ns for f in again["train"].cache_files} == files
    redone = data.lm_datasets(data.load_raw(_data_args(), cache), tokenizer, 32, overwrite_cache=True)
    assert {f["filename"]: os.stat(f["filename"]).st_mtime_ns for f in redone["train"].cache_files} != files

    streamed = data.lm_datasets(data.load_raw(_data_args(streaming=True), cache), tokenizer, 32)
    first = [b["input_ids"] for _, b in zip(range(50), streamed["train"])]
    assert first == blocks["train"][:50]["input_ids"]
    # the engine's example batch (trace, GPU profile) of a streamed dataset: its first examples
    assert example_batch(streamed["train"], default_data_collator, 4)["input_ids"].tolist() == first[:4]


def test_text_files_keep_or_drop_line_breaks(recipe, tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("first line\nsecond line\n\nthird line\n")
    kept = recipe.data.load_raw(_data_args(train_file=str(path), validation_split_percentage=50), str(tmp_path))
    dropped = recipe.data.load_raw(
        _data_args(train_file=str(path), validation_split_percentage=50, keep_linebreaks=False), str(tmp_path)
    )
    assert list(kept["train"]["text"]) == ["second line\n", "third line\n"]  # one document per line, as run_clm
    assert list(dropped["train"]["text"]) == ["second line", "third line"]


def test_a_split_without_one_block_is_an_error_naming_the_fix(recipe, tmp_path) -> None:
    """A held-out split too small for one block would evaluate on nothing (a Trainer logs no eval_loss)."""
    path = tmp_path / "corpus.txt"
    path.write_text("a long enough line of text to make several blocks of the training split\n" * 40 + "tiny\n")
    raw = recipe.data.load_raw(_data_args(train_file=str(path), validation_split_percentage=50), str(tmp_path))
    raw["validation"] = raw["validation"].select([len(raw["validation"]) - 1])  # "tiny" alone
    tokenizer = recipe.data.train_tokenizer(recipe.data.training_texts(raw, False), 300, 32)
    with pytest.raises(SystemExit, match=r"the validation split holds fewer than 32 tokens.*--block_size"):
        recipe.data.lm_datasets(raw, tokenizer, 32)


def test_the_default_corpus_leaves_out_small_files(recipe) -> None:
    """Some Python builds ship many empty ``__init__.py`` files; a held-out split of them holds no block."""
    texts = [json.loads(line)["text"] for line in recipe.data.stdlib_corpus(0.3).read_text().splitlines()]
    assert min(len(t.encode()) for t in texts) >= recipe.data.MIN_DOCUMENT_BYTES


def test_default_corpus_covers_the_gpu_default(recipe) -> None:
    """The GPU default (``gpt2``: 200 steps of 8 x 1024 tokens) must see well under two epochs of the
    default corpus: at the 3.8 characters per token measured for the recipe's 8192-token BPE on it
    (Python 3.11: 12.6 MB, 3.33M tokens), its training split must hold over 1.64M tokens."""
    corpus = recipe.data.stdlib_corpus()
    chars = sum(len(json.loads(line)["text"]) for line in corpus.read_text().splitlines())
    gpu_tokens = 200 * 8 * 1024
    epochs = gpu_tokens / (0.95 * chars / 3.8)
    assert epochs < 1.0, f"{chars / 1e6:.1f}M characters: {epochs:.2f} epochs"
    assert corpus == recipe.data.stdlib_corpus()  # built once, then read from the cache


def _local_model(recipe, folder: Path, kind: str) -> None:
    """A tiny Llama or Qwen2 folder with its own (local BPE) tokenizer, as a user's checkpoint is."""
    texts = [json.loads(line)["text"] for line in recipe.data.stdlib_corpus(0.1).read_text().splitlines()]
    tokenizer = recipe.data.train_tokenizer(texts, 320, 64)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize(
    "kind, extra", [("llama", []), ("qwen2", ["--streaming", "true"])], ids=["llama", "qwen2-streaming"]
)
def test_recipe_trains_a_local_model_folder(recipe, tmp_path, monkeypatch, kind: str, extra: list[str]) -> None:
    folder, out = tmp_path / kind, tmp_path / "run"
    _local_model(recipe, folder, kind)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(json.loads(line)["text"] for line in recipe.data.stdlib_corpus(0.1).read_text().splitlines())
    )
    args = [
        "--model_name_or_path",
        str(folder),
        "--train_file",
        str(corpus),
        "--cache_dir",
        str(tmp_path / "hf"),
        "--output_dir",
        str(out),
        "--max_steps",
        "8",
        "--logging_steps",
        "2",
        "--eval_steps",
        "8",
        "--max_eval_samples",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "3e-3",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        *extra,
    ]
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    recipe.train.main()

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert json.loads((out / "elixir_plan.json").read_text())["model"]["model_type"] == kind
    trained = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(trained).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    assert trained.config.max_position_embeddings == 64  # the default block: min(1024, the model's positions)
