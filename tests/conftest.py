"""Suite-wide setup: force offline Hub access and skip ``gpu`` tests without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Tests must never reach the Hub; set before transformers is imported by tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_report_header(config: pytest.Config) -> str:
    import transformers

    return f"elixir: torch {torch.__version__}, transformers {transformers.__version__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Honour the ``gpu`` marker: skip rather than fail on CPU-only machines."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
