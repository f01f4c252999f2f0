"""The SFT recipes (``recipes/sft``) on CPU, offline: each model's YAML trains a tiny model of its
family (its preset's config, sizes shrunk: Llama-3.1's rope scaling, Qwen2.5's q/k/v biases,
Mistral's) on a local Alpaca-style file, with ``--elixir auto``; the loss falls and the engine ran.
The answer-only labels and the recipe YAML's checks run without training."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from elixir_hf.presets import PRESETS

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "sft"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = {  # the shape fields every family's preset sets, shrunk
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
COLOURS = "red green blue amber violet cyan olive coral".split()


@pytest.fixture(scope="module")
def sft() -> Iterator[ModuleType]:
    """``recipes/sft/train.py`` under its own name (the GPT-2 recipe has a ``train`` module too)."""
    sys.path.insert(0, str(RECIPE))  # its sibling chat_data.py
    try:
        spec = importlib.util.spec_from_file_location("sft_train", RECIPE / "train.py")
        module = sys.modules["sft_train"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(RECIPE))
        sys.modules.pop("sft_train", None)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = [f"Name the colour after {c}. The colour after {c} is" for c in COLOURS] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Alpaca rows whose answer follows from the prompt: next colour in a fixed cycle."""
    path = tmp_path_factory.mktemp("sft-data") / "colours.jsonl"
    rows = [
        {"instruction": "Name the colour after this one.", "input": c, "output": COLOURS[(i + 1) % len(COLOURS)]}
        for i, c in enumerate(COLOURS)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows * 8) + "\n")
    return path


def _tiny_model(recipe: str, tokenizer: PreTrainedTokenizerFast, folder: Path) -> str:
    family, fields = PRESETS[recipe]
    config = AutoConfig.for_model(
        family, **{**fields, **TINY, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return type(model).__name__


def test_every_recipe_is_a_preset(sft) -> None:
    """Each YAML names a preset of the same name (elixir-plan --model NAME, the benchmarks' models)."""
    assert sft.RECIPES == ["llama3.1-8b", "mistral-7b-v0.3", "qwen2.5-14b", "qwen2.5-7b"]
    assert all(name in PRESETS for name in sft.RECIPES)


@pytest.mark.parametrize("recipe", ["llama3.1-8b", "qwen2.5-7b", "qwen2.5-14b", "mistral-7b-v0.3"])
def test_recipe_trains_a_tiny_model_of_its_family(sft, tokenizer, data_file, tmp_path, recipe: str) -> None:
    model_class = _tiny_model(recipe, tokenizer, tmp_path / "model")
    out = tmp_path / "run"
    sft.main(
        [
            "--recipe",
            recipe,
            "--model_name_or_path",
            str(tmp_path / "model"),
            "--dataset",
            str(data_file),
            "--output_dir",
            str(out),
            "--elixir",
            "auto",
            "--max_steps",
            "8",
            "--logging_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--learning_rate",
            "1e-2",
            "--warmup_steps",
            "0",
            "--lr_scheduler_type",
            "constant",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert all("elixir/step_s" in h for h in history if "loss" in h)  # the engine stepped
    plan = json.loads((out / "elixir_plan.json").read_text())
    assert plan["model"]["class"] == model_class
    assert type(AutoModelForCausalLM.from_pretrained(str(out))).__name__ == model_class


def test_labels_are_the_answers_only(tokenizer) -> None:
    """Every assistant turn (and its end token) is learned from; system, user and headers are not."""
    sys.path.insert(0, str(RECIPE))
    try:
        from chat_data import IGNORE, tokenize_conversation
    finally:
        sys.path.remove(str(RECIPE))
    messages = [
        {"role": "system", "content": "Answer with a colour."},
        {"role": "user", "content": "After red?"},
        {"role": "assistant", "content": "green"},
        {"role": "user", "content": "After green?"},
        {"role": "assistant", "content": "blue"},
    ]
    enc = tokenize_conversation(messages, tokenizer, 256)
    learned = [t for t, label in zip(enc["input_ids"], enc["labels"], strict=True) if label != IGNORE]
    assert tokenizer.decode(learned) == "green<|im_end|>\nblue<|im_end|>\n"
    cut = tokenize_conversation(messages, tokenizer, 12)  # cut inside the prompt: nothing to learn
    assert len(cut["input_ids"]) == 12 and set(cut["labels"]) == {IGNORE}


def test_a_template_that_moves_turns_is_refused(tokenizer) -> None:
    """A template rendering the system text into the last user turn would mislabel earlier answers."""
    sys.path.insert(0, str(RECIPE))
    try:
        from chat_data import answer_spans
    finally:
        sys.path.remove(str(RECIPE))
    moving = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    moving.chat_template = (
        "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
        "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}[INST] "
        "{% if loop.last and sys %}{{ sys }} {% endif %}{{ m['content'] }}[/INST]{% else %} {{ m['content'] }}"
        "{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="assistant turn 2"):
        answer_spans(messages, moving)


def test_recipe_yaml_keys_are_checked(sft, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: x\nper_device_batch_size: 8\n")
    with pytest.raises(SystemExit, match=r"bad.yaml: Unknown arguments from config file: .*per_device_batch_size"):
        sft.parse_args(["--recipe", str(bad)])
    with pytest.raises(SystemExit, match="no such file"):
        sft.parse_args(["--recipe", "llama-9b"])
    args, training = sft.parse_args(["--recipe", "qwen2.5-14b", "--learning_rate", "3e-5", "--output_dir", "x"])
    assert args.model_name_or_path == "Qwen/Qwen2.5-14B-Instruct" and training.per_device_train_batch_size == 8
    assert training.learning_rate == 3e-5  # the command line over the YAML (1e-5)


def test_the_recipe_is_parsed_by_trls_parser(sft, tmp_path) -> None:
    """``--recipe NAME`` is TrlParser's ``--config``: the YAML over the defaults, the command line over the YAML,
    the ``elixir`` key (a mapping, YAML's booleans) honoured, ``env:`` set."""
    assert sft.TrlParser.__module__.startswith("trl")
    args, training = sft.parse_args(["--recipe", "qwen2.5-14b", "--output_dir", str(tmp_path), "--use_cpu", "true"])
    assert args.model_name_or_path == "Qwen/Qwen2.5-14B-Instruct" and training.learning_rate == 1e-5
    assert training.num_train_epochs == 1 and training.elixir_plugin is not None  # training_defaults
    own = tmp_path / "own.yaml"
    own.write_text(
        f"model_name_or_path: m\noutput_dir: {tmp_path}\nuse_cpu: true\nlearning_rate: 3.0e-5\n"
        "elixir: {mode: static, offload: 0.5}\nenv: {SFT_RECIPE_TEST: 'yes'}\n"
    )
    _, training = sft.parse_args(["--config", str(own), "--learning_rate", "4e-5"])
    assert training.learning_rate == 4e-5 and training.elixir_plugin.config.offload == 0.5
    assert os.environ.pop("SFT_RECIPE_TEST") == "yes"
    for word, on in (("off", False), ("true", True)):
        own.write_text(f"model_name_or_path: m\noutput_dir: {tmp_path}\nuse_cpu: true\nelixir: {word}\n")
        assert (sft.parse_args(["--recipe", str(own)])[1].elixir_plugin is not None) is on
    with pytest.raises(SystemExit, match="not both"):
        sft.parse_args(["--recipe", "qwen2.5-7b", "--config", str(own)])


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("{ofload: 0.5}", "unknown {}'s elixir key 'ofload' \\(did you mean 'offload'\\?\\)"),
        ("'{\"offload\": 0.5'", "{}'s elixir is not valid JSON"),
        ("[0.5]", "{}'s elixir '\\[0.5\\]' is not understood"),
        ("{offload: 2}", "{}'s elixir: ElixirConfig.offload must be a fraction"),
    ],
)
def test_a_bad_elixir_value_in_the_yaml_is_refused_naming_key_and_file(sft, tmp_path, value, refusal) -> None:
    own = tmp_path / "own.yaml"
    own.write_text(f"model_name_or_path: m\nelixir: {value}\n")
    with pytest.raises(SystemExit, match=refusal.format(re.escape(str(own)))):
        sft.parse_args(["--recipe", str(own)])
