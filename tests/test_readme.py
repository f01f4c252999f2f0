"""The README's quickstarts run as written, so that they cannot rot.

Each ```python block after a ``<!-- readme-test: NAME.py -->`` marker is saved as NAME.py in a
folder that holds what the README says the examples need: ``my-model/`` (a tiny Llama with a
byte-level BPE tokenizer, Llama-3's special tokens and no pad token, written here) and
``train.txt``. The command is the first line of the ```bash block that follows it (``elixir-run``
becomes ``python -m elixir_hf.commands.run``). Nothing in the code is substituted. Each run must train with
the engine: the weights (or the LoRA adapter, which starts at zero) change, and no logged
gradient norm is zero; and a FutureWarning of transformers that the quickstart's code or
elixir-hf's causes is an error (``helpers/future_warnings.py``), on each transformers the suite runs on.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FUTURE_WARNINGS = ROOT / "tests" / "helpers" / "future_warnings.py"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARKER = re.compile(r"<!-- readme-test: (\S+) -->")

EXPECTED = {  # script -> (the model class whose plan the HF integration prints, or None; what it saves)
    "finetune.py": ("LlamaForCausalLM", "out/full/model.safetensors"),
    "sft_lora.py": ("PeftModelForCausalLM", "out/lora/adapter_model.safetensors"),
    "loop.py": (None, "out/loop/model.safetensors"),
}


def quickstarts() -> dict[str, tuple[str, str]]:
    """``{file name: (its code, the command that runs it)}`` for every marked block of the README."""
    text = README.read_text()
    fences = list(FENCE.finditer(text))
    found = {}
    for marker in MARKER.finditer(text):
        following = [f for f in fences if f.start() > marker.end()]
        assert len(following) >= 2, f"{marker.group(0)}: needs a python block and a bash block after it"
        code, run = following[:2]
        assert code.group(1) == "python" and not text[marker.end() : code.start()].strip(), (
            f"{marker.group(0)} must stand right before a ```python block"
        )
        assert run.group(1) == "bash", f"{marker.group(0)}: the block after its code must be ```bash (the command)"
        command = next(line for line in run.group(2).splitlines() if line.strip()).split("#")[0]
        found[marker.group(1)] = (code.group(2), command.strip())
    return found


def argv(command: str) -> list[str]:
    """The command, run by ``helpers/future_warnings.py`` (as ``python`` would run it)."""
    words = shlex.split(command)
    if words[0] == "elixir-run":
        return [sys.executable, str(FUTURE_WARNINGS), "-m", "elixir_hf.commands.run", *words[1:]]
    assert words[0] == "python", f"unknown command in the README: {command!r}"
    return [sys.executable, str(FUTURE_WARNINGS), *words[1:]]


def write_tiny_model(folder: Path) -> None:
    """``train.txt`` and ``my-model/``: a 2-layer Llama (untied head, GQA) and a BPE trained on the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = (
        "the a model train chunk memory offload GPU host rank plan batch step loss token layer weight "
        "gradient adam fast slow large small data text line"
    ).split()
    lines = [" ".join(rng.choices(words, k=rng.randint(8, 24))).capitalize() + "." for _ in range(400)]
    (folder / "train.txt").write_text("\n".join(lines) + "\n")

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=384,
            special_tokens=[bos, eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bpe.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, model_max_length=1024)
    tokenizer.save_pretrained(folder / "my-model")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder / "my-model")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, tuple[Path, subprocess.Popen]]]:
    """Every quickstart started at once in one folder (they write to different ``out/`` folders):
    each is mostly a single-threaded import of transformers, so together they take about half the
    wall time of one after another on two cores. ``{name: (folder, process)}``."""
    folder = tmp_path_factory.mktemp("readme")
    write_tiny_model(folder)
    env = {k: v for k, v in os.environ.items() if k != "ELIXIR_CONFIG"}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_DATASETS_CACHE": str(folder / "datasets-cache"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
        }
    )
    started = {}
    with contextlib.ExitStack() as logs:
        for name, (code, command) in quickstarts().items():
            (folder / name).write_text(code)
            log = logs.enter_context(open(folder / f"{name}.log", "w"))
            started[name] = (
                folder,
                subprocess.Popen(argv(command), cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT),
            )
        try:
            yield started
        finally:
            for _, proc in started.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def test_the_readme_tags_every_quickstart() -> None:
    """A tagged block without expectations here (or a quickstart untagged) fails, not skips."""
    assert set(quickstarts()) == set(EXPECTED)


@pytest.mark.once  # launched processes: their transformers code runs in-process on 5.17 too (Makefile)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quickstart_runs_as_written(runs, name: str) -> None:
    assert name in runs, f"README.md has no block tagged <!-- readme-test: {name} -->"
    workdir, proc = runs[name]
    proc.wait(timeout=300)
    out = (workdir / f"{name}.log").read_text()
    assert proc.returncode == 0, f"{' '.join(proc.args)}:\n{out[-5000:]}"

    model_class, saved = EXPECTED[name]
    if model_class is not None:  # the HF integration logs the plan (log_level="info") and saves it
        assert f"Elixir plan for {model_class}" in out, out[-3000:]
        assert (workdir / saved).with_name("elixir_plan.json").is_file()
    norms = [float(n) for n in re.findall(r"'grad_norm': '([^']+)'", out)]
    assert all(n > 0 for n in norms), f"a zero gradient norm: nothing trained ({norms})"
    weights = load_file(workdir / saved)
    if "adapter" in saved:  # LoRA's B matrices start at zero: nonzero means the adapters were trained
        lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
        assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values()), "the LoRA adapter did not train"
    else:
        before = load_file(workdir / "my-model" / "model.safetensors")
        assert weights.keys() == before.keys()
        assert any(not torch.equal(weights[k], before[k]) for k in before), "the weights did not change"
