"""The engine's progress bars: none unless a factory is installed; then one per long step, run to its total."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import elixir_runtime as er
from elixir_runtime.progress import set_progress_factory
from helpers.logs import recorded_bars
from helpers.models import make_batch, tiny_gpt2

ENGINE = Path(er.__file__).parent


def test_the_engine_alone_draws_no_bars(capfd) -> None:
    """No factory by default, none installed by the engine itself, and without one nothing is drawn."""
    spec = importlib.util.spec_from_file_location("fresh_progress", ENGINE / "progress.py")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # as a process without elixir_hf has it
    with fresh.progress(3, "elixir: anything") as bar:
        assert isinstance(bar, fresh._NoBar)
    assert [p.name for p in ENGINE.rglob("*.py") if "set_progress_factory(" in p.read_text()] == ["progress.py"]
    previous = set_progress_factory(None)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        er.prepare(model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(device=torch.device("cpu")))
        model.state_dict()
    finally:
        set_progress_factory(previous)
    out, err = capfd.readouterr()
    assert "elixir: " not in out + err and "\r" not in err


def test_prepare_and_state_dict_bars() -> None:
    model = tiny_gpt2()
    with recorded_bars() as bars:
        er.prepare(
            model,
            torch.optim.AdamW(model.parameters()),
            er.ElixirConfig(device=torch.device("cpu"), offload=0.5),
            example_batch=make_batch(128),
        )
        model.state_dict()
    chunks = len(model._elixir.runtime.layout.chunks)
    assert [b.desc for b in bars] == [
        "elixir: filling device chunk shards",
        "elixir: filling host chunk shards",
        "elixir: gathering the weights",
    ]
    assert sum(b.total for b in bars[:2]) == bars[2].total == chunks
    assert all(b.n == b.total and b.closed and b.unit == "chunk" for b in bars)
