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
from hf_cases import VOCAB, history, make_trainer, training_args

from helpers.models import MODEL_BUILDERS

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")

RTOL = 2e-2
"""bf16 compute against bf16 autocast over fp32 weights: ~1e-3 observed on the first steps."""


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)


@pytest.fixture(autouse=True)
def _liger_patches_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger rebinds transformers' Llama module for the process (its norm, MLP and rotary embedding,
    the causal LM's forward): undone after the test, or a later test's tiny Llama in the same process
    runs Liger's kernels (``make test-gpu`` runs every ``gpu`` test in one)."""
    from transformers.models.llama import modeling_llama

    for name, value in [(n, v) for n, v in vars(modeling_llama).items() if not n.startswith("__")]:
        monkeypatch.setattr(modeling_llama, name, value)  # the value now, restored after the test
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)


def _args(path: str, elixir: str | None) -> object:
    args = training_args(
        path,
        elixir,
        use_cpu=False,
        bf16=True,
        use_liger_kernel=True,
        max_steps=10,
        learning_rate=1e-3,
        eval_strategy="no",
    )
    # One GPU, as Elixir's process uses: without a launcher the stock Trainer wraps the model in
    # DataParallel on a machine with two (on 2 x H200 its replica read an embedding across GPUs).
    args._n_gpu = 1
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("elixir", ["auto", '{"mode": "static", "n_blocks": "min", "offload": 1.0}'])
def test_liger_trains_as_the_stock_trainer(tmp_path, elixir: str) -> None:
    stock = make_trainer("llama", _args(str(tmp_path / "stock"), None))
    stock.train()
    ours = make_trainer("llama", _args(str(tmp_path / "elixir"), elixir))
    ours.train()
    table = ours.model._elixir.live.param_table
    head = ours.model.lm_head.weight
    assert table.resident[table.index[id(head)]]  # found by the trace, not named
    got, want = history(ours, "loss"), history(stock, "loss")
    assert len(got) == len(want) == 10
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=RTOL), f"loss[{i}]: elixir {g} vs stock {w}"
    # the head, read only by Liger's loss, trained as the stock one did: its distance from the stock
    # head is a small part of how far both moved (in norm: rows of tokens never seen get Adam steps of
    # noise-level gradients, which bf16 and fp32 round differently) (random tokens: the loss itself barely moves)
    start = MODEL_BUILDERS["llama"](seed=0, vocab=VOCAB).lm_head.weight.detach()
    mine = ours.model.state_dict()["lm_head.weight"].float().cpu()
    theirs = stock.model.lm_head.weight.detach().float().cpu()
    moved = (theirs - start).norm()
    assert moved > 0 and (mine - theirs).norm() < 0.1 * moved
