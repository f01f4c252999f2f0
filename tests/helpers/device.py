"""Where the engine's tests compute: the CPU, unless ``ELIXIR_TEST_DEVICE=cuda`` (``make test-gpu``).

``prepare`` without ``ElixirConfig.device`` computes on CUDA wherever CUDA is there, so on a GPU
machine a test written for the CPU would put the model on the GPU and keep its batches on the CPU.
``pin_engine_device`` makes such a ``prepare`` compute on the test device instead, in the test
process (``tests/conftest.py``) and in every rank of ``helpers.dist``. With ``ELIXIR_TEST_DEVICE=cuda``
the recipes of ``helpers.training`` put their batches and reference models on each rank's GPU too,
and ``helpers.dist`` joins the ranks over NCCL.
"""

from __future__ import annotations

import os

import torch

import elixir_runtime.api as engine_api

TEST_DEVICE = os.environ.get("ELIXIR_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"ELIXIR_TEST_DEVICE={TEST_DEVICE!r}: use cpu (the default) or cuda")
ON_CUDA = TEST_DEVICE == "cuda"


def rank_device(rank: int = 0) -> torch.device:
    """The device rank ``rank`` computes on: the CPU, or its own GPU."""
    return torch.device("cuda", rank) if ON_CUDA else torch.device("cpu")


def pin_engine_device(rank: int | None = None, setattr=setattr) -> None:
    """``prepare`` without ``ElixirConfig.device`` computes on ``rank``'s test device (default: the
    process's ``LOCAL_RANK``, else 0). ``setattr``: a ``MonkeyPatch.setattr``, undone after the test."""
    unpinned = engine_api._resolve_device

    def resolve(config):
        if config.device is not None:
            return unpinned(config)
        return rank_device(int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank)

    setattr(engine_api, "_resolve_device", resolve)
