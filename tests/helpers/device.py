"""Where the engine's tests compute: the CPU, unless ``ELIXIR_TEST_DEVICE=cuda`` (``make test-gpu``).

On the CPU the suite sees no GPU (``tests/conftest.py`` hides them), so ``prepare`` without
``ElixirConfig.device`` computes on the CPU on any machine; with ``cuda`` it computes on the current
GPU (each rank of ``helpers.dist`` its own). One rule for the tests: they compute on ``local_device()``.
The batches of ``helpers.models`` and ``helpers.training`` are made there, and a plain-PyTorch model a
test compares the engine against is put there (``device=local_device()`` of the tiny models'
builders). A model that goes to ``prepare`` is built on the CPU, where a user's is.
"""

from __future__ import annotations

import os

import torch

TEST_DEVICE = os.environ.get("ELIXIR_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"ELIXIR_TEST_DEVICE={TEST_DEVICE!r}: use cpu (the default) or cuda")
ON_CUDA = TEST_DEVICE == "cuda"


def rank_device(rank: int) -> torch.device:
    """The device ``helpers.dist`` gives rank ``rank``: the CPU, or its own GPU (made its current one)."""
    return torch.device("cuda", rank) if ON_CUDA else torch.device("cpu")


def local_device(kind: str = TEST_DEVICE) -> torch.device:
    """Where this process computes for a test on ``kind`` (``cpu`` or ``cuda``; a ``gpu`` test asks
    for ``cuda`` whatever the suite's device): the CPU, or the current GPU (a rank's own, GPU 0 in
    the test process)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
