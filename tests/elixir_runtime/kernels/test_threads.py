"""The CPU Adam's threads: the rank's share of the cores, whatever ``OMP_NUM_THREADS`` says."""

from __future__ import annotations

import pytest
import torch

import elixir_runtime as er
from elixir_runtime import host
from elixir_runtime.kernels.threads import cpu_adam_threads
from helpers.models import make_batch, tiny_gpt2


@pytest.mark.parametrize(
    "cores, ranks, expected",
    [(16, 1, 15), (32, 2, 15), (64, 4, 15), (16, 4, 3), (2, 1, 2), (4, 2, 2), (3, 4, 1)],
)
def test_share_of_the_cores_less_one_for_the_training_loop(monkeypatch, cores, ranks, expected) -> None:
    monkeypatch.setattr(host, "usable_cores", lambda: cores)
    assert cpu_adam_threads(ranks) == expected


def test_a_given_core_count_is_shared_the_same_way() -> None:
    assert cpu_adam_threads(2, cores=32) == 15 and cpu_adam_threads(1, cores=2) == 2


def test_an_explicit_count_wins_and_must_be_positive() -> None:
    assert cpu_adam_threads(8, requested=5) == 5
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        cpu_adam_threads(1, requested=0)


def _engine_threads(**config) -> tuple[int, int]:
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = er.ElixirConfig(mode="static", offload=0.5, device="cpu", **config)
    _, opt = er.prepare(model, opt, config, example_batch=make_batch(128))
    return opt.cpu_threads, opt.kernels["host"]._threads


def test_the_engine_ignores_torchruns_single_thread_default(monkeypatch) -> None:
    """torchrun's OMP_NUM_THREADS=1 (here: torch.set_num_threads(1)) does not reach the CPU Adam:
    two ranks on a 12-core host get 5 threads each; ``cpu_threads`` overrides."""
    monkeypatch.setattr(host, "usable_cores", lambda: 12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _engine_threads() == (5, 5)
        assert _engine_threads(cpu_threads=3) == (3, 3)
    finally:
        torch.set_num_threads(before)
