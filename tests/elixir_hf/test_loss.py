"""``elixir_hf.loss``: the lean causal-LM cross-entropy gives transformers' ``ForCausalLMLoss`` value
and, to the bit, its logits gradient, keeps no fp32 copy of the logits (what autograd saves, and the planner's
traced activation peak), and ``build_engine`` installs it only in place of the stock loss."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import elixir_hf.loss as lean
from elixir_hf import ElixirPlugin, ElixirSpecError
from elixir_hf.engine import build_engine
from elixir_runtime.profiler.profile import profile_model
from helpers.logs import captured
from helpers.models import make_batch, tiny_llama

VOCAB, BATCH, SEQ = 1000, 4, 33
IGNORE = -100


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """10 rows a block: 132 rows make 14 blocks, the last one ragged."""
    monkeypatch.setattr(lean, "BLOCK_BYTES", 4 * VOCAB * 10)
    return 10


def _labels(seed: int, ignored: float, ignore_index: int = IGNORE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return labels.masked_fill(torch.rand(BATCH, SEQ, generator=gen) < ignored, ignore_index)


CASES = {  # name: the keyword arguments besides logits, labels and vocab_size
    "mean": {},
    "num_items_tensor": {"num_items_in_batch": torch.tensor(97)},
    "num_items_int": {"num_items_in_batch": 97},
    "shift_labels": {"shift_labels": _labels(2, 0.3)},
    "ignore_index_7": {"ignore_index": 7},  # labels ignored with 7 (-100 is then out of range)
    "unused_kwargs": {"position_ids": torch.arange(SEQ)},
}


def _case_labels(case: str) -> torch.Tensor:
    return _labels(1, 0.3, CASES[case].get("ignore_index", IGNORE))


def _both(logits: torch.Tensor, labels: torch.Tensor, **kwargs):
    """(loss, logits grad) of the stock loss and of the lean one on the same logits."""
    out = []
    for fn in (ForCausalLMLoss, lean.lean_causal_lm_loss):
        x = logits.detach().clone().requires_grad_()
        loss = fn(x, labels, VOCAB, **kwargs)
        loss.backward()
        out.append((loss.detach(), x.grad))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(small_blocks, case: str, dtype: torch.dtype) -> None:
    """The loss to fp32 rounding (relative 1e-6: the sum over rows runs in another order); the
    logits' gradient to the bit (torch's own log-softmax backward, on the same fp32 values)."""
    logits = (3 * torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(0))).to(dtype)
    (want, want_grad), (got, got_grad) = _both(logits, _case_labels(case), **CASES[case])
    assert got.dtype == want.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(_bits(got_grad), _bits(want_grad))


@pytest.mark.parametrize("num_items", [None, torch.tensor(0), 5])
def test_all_ignored_batch(small_blocks, num_items) -> None:
    """As torch gives: a mean over no tokens is NaN (0 / 0), a sum over them 0 / num_items; the
    gradient is zero either way."""
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(0)).bfloat16()
    labels = torch.full((BATCH, SEQ), IGNORE)
    (want, want_grad), (got, got_grad) = _both(logits, labels, num_items_in_batch=num_items)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.isnan(got).item() == (num_items is None or torch.is_tensor(num_items))
    assert torch.equal(_bits(got_grad), _bits(want_grad)) and not got_grad.any()


@pytest.mark.parametrize("label", [-100, VOCAB])
def test_a_label_out_of_range_fails_in_both(label: int) -> None:
    logits, labels = torch.randn(BATCH, SEQ, VOCAB), torch.full((BATCH, SEQ), label)
    for fn in (ForCausalLMLoss, lean.lean_causal_lm_loss):
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            fn(logits, labels, VOCAB, ignore_index=7)


def _saved_for_backward(fn, logits: torch.Tensor, labels: torch.Tensor) -> dict[int, torch.Tensor]:
    """The distinct storages autograd keeps for backward, by address."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, labels, VOCAB)
    return saved


def test_saves_the_logits_and_one_value_per_row(small_blocks) -> None:
    """The stock loss keeps an fp32 (rows, vocab) log-softmax for backward; the lean one the bf16
    logits themselves (no copy) and vectors of one element per row."""
    logits = torch.randn(BATCH, SEQ, VOCAB).bfloat16().requires_grad_()
    labels = _labels(1, 0.3)
    rows = BATCH * SEQ

    stock = _saved_for_backward(ForCausalLMLoss, logits, labels)
    assert any(t.dtype == torch.float32 and t.numel() == rows * VOCAB for t in stock.values())

    saved = _saved_for_backward(lean.lean_causal_lm_loss, logits, labels)
    assert logits.untyped_storage().data_ptr() in saved  # the input itself, not a copy
    others = [t for p, t in saved.items() if p != logits.untyped_storage().data_ptr()]
    assert others and all(t.dim() <= 1 and t.numel() <= rows for t in others), [(t.dtype, t.shape) for t in others]


def test_planner_sees_the_smaller_activation_peak() -> None:
    """The profiler traces the step on fake tensors: the lean loss runs there, and the traced
    activation peak (what the planner budgets for) drops by more than 1.25 fp32 copies of the
    logits (the stock loss holds 3 at once in backward; the lean one the bf16 logits, their
    gradient and 3 blocks of 1/8 of the rows, ``MIN_BLOCKS``; 26.9 -> 14.9 MiB observed, one fp32
    copy being 8 MiB)."""
    vocab, ids = 4096, torch.randint(0, 4096, (8, 64), generator=torch.Generator().manual_seed(0))
    peaks = []
    for use in (False, True):
        model = tiny_llama(vocab=vocab)
        if use:
            assert lean.use_lean_loss(model) == ["LlamaForCausalLM"]
        profile = profile_model(model, {"input_ids": ids, "labels": ids}, dtype=torch.bfloat16, device="cpu")
        peaks.append(profile.activation_peak)
    assert peaks[0] - peaks[1] > 1.25 * ids.numel() * vocab * 4, peaks


# --------------------------------------------------------------------------- installation


def _engine(model: torch.nn.Module, spec: str = "auto") -> torch.nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    build_engine(model, opt, ElixirPlugin.from_spec(spec), torch.device("cpu"), make_batch(128))
    return model


def test_build_engine_installs_the_lean_loss(caplog) -> None:
    with captured(caplog, logging.INFO, "elixir_hf.loss"):
        model = _engine(tiny_llama())
    assert model.loss_function is lean.lean_causal_lm_loss
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "elixir_hf.loss"] == ["LlamaForCausalLM"]


def test_a_users_loss_function_is_kept() -> None:
    def mine(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    model = tiny_llama()
    model.loss_function = mine
    assert _engine(model).loss_function is mine


def test_lean_loss_off_keeps_the_stock_loss() -> None:
    model = _engine(tiny_llama(), '{"lean_loss": false}')
    assert model.loss_function is ForCausalLMLoss


def test_lean_loss_must_be_a_bool() -> None:
    with pytest.raises(
        ElixirSpecError, match=r"^--elixir: ElixirPlugin.lean_loss must be true or false, got 'no' \(str\)"
    ):
        ElixirPlugin.from_spec('{"lean_loss": "no"}')
    with pytest.raises(ElixirSpecError, match=r"^ElixirPlugin.lean_loss must be true or false, got 1 \(int\)"):
        ElixirPlugin(lean_loss=1)


def test_a_peft_model_gets_it_on_the_model_it_wraps() -> None:
    import peft

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert lean.use_lean_loss(model) == ["LlamaForCausalLM"]
    assert model.get_base_model().loss_function is lean.lean_causal_lm_loss
