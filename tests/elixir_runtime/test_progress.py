"""The engine's progress bars: none unless a factory is installed; then one per long step, run to its total."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import elixir_runtime as er
from helpers.logs import recorded_bars
from helpers.models import make_batch, tiny_gpt2

SRC = Path(__file__).resolve().parents[2] / "src"

ALONE = """
import torch, elixir_runtime as er
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
model, opt = er.prepare(model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(device=torch.device("cpu")))
model.state_dict()
"""


def test_the_engine_alone_draws_no_bars() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ALONE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "elixir: " not in proc.stderr + proc.stdout


def test_prepare_and_state_dict_bars() -> None:
    model = tiny_gpt2()
    with recorded_bars() as bars:
        er.prepare(model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(device=torch.device("cpu"), offload=0.5),
                   example_batch=make_batch(128))
        model.state_dict()
    chunks = len(model._elixir.runtime.layout.chunks)
    assert [b.desc for b in bars] == ["elixir: filling device chunk shards", "elixir: filling host chunk shards",
                                      "elixir: gathering the weights"]
    assert sum(b.total for b in bars[:2]) == bars[2].total == chunks
    assert all(b.n == b.total and b.closed and b.unit == "chunk" for b in bars)
