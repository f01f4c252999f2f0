"""The GPT-2 recipe end to end on CPU, offline: its defaults (tiny model, stdlib corpus, locally
trained tokenizer, --elixir auto), shortened to a few steps. It must print the plan, lower the
loss, report perplexity and leave a model that ``from_pretrained`` loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt2" / "train.py"


def test_default_recipe_trains_offline(tmp_path) -> None:
    out = tmp_path / "run"
    env = {
        **os.environ,
        "ELIXIR_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("ELIXIR_CONFIG", None)
    args = ["--output_dir", str(out), "--max_steps", "16", "--logging_steps", "4", "--eval_steps", "8",
            "--max_eval_samples", "16", "--disable_tqdm", "true"]
    proc = subprocess.run([sys.executable, str(RECIPE), *args], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]

    assert "Elixir plan for GPT2LMHeadModel" in proc.stdout and "rCache blocks" in proc.stdout
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    evals = json.loads((out / "eval_results.json").read_text())
    assert evals["eval_perplexity"] < 2048  # below the uniform guess over the tokenizer's 2048 tokens
    assert (out / "checkpoint-16" / "elixir_plan.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("Return the number of items in a container.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
