"""Liger's kernels under the engine, on a GPU: ``--use_liger_kernel`` patches the model's norms, MLPs
and rotary embedding with Triton kernels and its forward with the fused linear cross entropy, which
reads ``lm_head.weight`` without calling ``lm_head``. The plan's trace skips the kernels on fake
tensors and finds that read (``profiler/launches.py``, ``profiler/outside.py``); the losses are the
stock Trainer's with Liger on fp32 weights (bf16 autocast), within bf16's tolerance. The same
mechanism is covered on the CPU by ``tests/elixir_runtime/profiler/test_custom_kernels.py`` and
``tests/elixir_runtime/runtime/test_resident.py``."""

from __future__ import annotations

import math

import pytest
from hf_cases import history, make_trainer, training_args

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")

RTOL = 2e-2
"""bf16 compute against bf16 autocast over fp32 weights: ~1e-3 observed on the first steps."""


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


def _args(path: str, elixir: str | None) -> object:
    return training_args(
        path,
        elixir,
        use_cpu=False,
        bf16=True,
        use_liger_kernel=True,
        max_steps=10,
        learning_rate=1e-3,
        eval_strategy="no",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("elixir", ["auto", '{"mode": "static", "n_blocks": "min", "offload": 1.0}'])
def test_liger_trains_as_the_stock_trainer(tmp_path, elixir: str) -> None:
    stock = make_trainer("llama", _args(str(tmp_path / "stock"), None))
    stock.train()
    ours = make_trainer("llama", _args(str(tmp_path / "elixir"), elixir))
    ours.train()
    plan = ours.model._elixir.plan
    head = ours.model.lm_head.weight
    assert plan.param_table.resident[plan.param_table.index[id(head)]]  # found by the trace, not named
    got, want = history(ours, "loss"), history(stock, "loss")
    assert len(got) == len(want) == 10
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=RTOL), f"loss[{i}]: elixir {g} vs stock {w}"
    assert got[-1] < got[0]  # it trains
