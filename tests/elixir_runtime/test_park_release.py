"""``park`` (the trained values readable in ``model.parameters()`` between steps) and ``release`` (the
engine off the model, its memory freed, the model prepared again)."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
from torch import nn

import elixir_runtime as er
from helpers.models import make_batch, tiny_gpt2, tiny_llama

OFFLOAD = dict(mode="static", n_blocks="min", offload=0.5)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def _train(model: nn.Module, opt: er.ElixirOptimizer, steps: int = 2, seed: int = 0) -> None:
    for i in range(steps):
        opt.backward(model(**make_batch(128, seed=seed + i)).loss)
        opt.step()
        opt.zero_grad()


def _stock(model: nn.Module, steps: int = 2) -> nn.Module:
    opt = _adamw(model)
    for i in range(steps):
        model(**make_batch(128, seed=i)).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _prepared(model: nn.Module, dtype: str | None = None) -> tuple[nn.Module, er.ElixirOptimizer]:
    config = er.ElixirConfig(**OFFLOAD, **({"dtype": dtype} if dtype else {}))
    return er.prepare(model, _adamw(model), config=config, example_batch=make_batch(128))


def _unit_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules() if m is not model)


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2-tied", "llama"])
def test_parked_parameters_read_the_trained_values_as_torch_trains_them(build) -> None:
    want = _stock(build())
    model, opt = _prepared(build())
    _train(model, opt)
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())  # placeholders between steps

    parked = er.park(model)

    assert parked.where == "shards" and parked.copied_bytes == 0  # one rank, fp32: views of the masters
    got = dict(model.named_parameters())
    for name, p in want.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert _unit_hooks(model) == 0  # the units' hooks are off while parked


def test_the_next_step_takes_the_parameters_back_and_trains_as_before() -> None:
    a, opt_a = _prepared(tiny_gpt2())
    b, opt_b = _prepared(tiny_gpt2())
    _train(a, opt_a)
    _train(b, opt_b)
    er.park(a)
    loss_parked = a(**make_batch(128, seed=9)).loss  # a forward takes them back, its hooks on again
    loss_plain = b(**make_batch(128, seed=9)).loss
    assert torch.equal(loss_parked, loss_plain)
    assert _unit_hooks(a) == _unit_hooks(b) > 0
    opt_a.backward(loss_parked)
    opt_a.step()
    opt_b.backward(loss_plain)
    opt_b.step()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_parameters_no_arena_holds_in_their_dtype_are_copies() -> None:
    """A bf16 run of an fp32 model keeps fp32 masters (views); bf16 weights trained in fp32 have no
    bf16 arena: copies, cast to each parameter's dtype."""
    model, opt = _prepared(tiny_gpt2().to(torch.bfloat16), dtype="fp32")
    _train(model, opt, steps=1)
    want = model.state_dict()
    parked = er.park(model)
    assert parked.where == "host" and parked.copied_bytes == 2 * sum(p.numel() for p in model.parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, want[name]), name


def test_full_params_and_a_load_take_the_parameters_back() -> None:
    model, opt = _prepared(tiny_gpt2())
    _train(model, opt, steps=1)
    fresh = copy.deepcopy(tiny_gpt2(seed=1).state_dict())
    er.park(model)
    model.load_state_dict(fresh)
    with er.full_params(model):
        for name, p in model.named_parameters():
            assert torch.equal(p, fresh[name]), name
    er.park(model)
    assert all(torch.equal(p, fresh[n]) for n, p in model.named_parameters())


def _engine_bytes(state: er.ElixirState) -> int:
    rt = state.runtime
    tensors = [t for a in rt.arenas.values() for t in vars(a).values() if isinstance(t, torch.Tensor)]
    tensors += [b.data for b in rt.rcache.buffers]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc's ``mallinfo2``: chunks in use in its arenas
    and mapped on their own), whether or not glibc has given the pages back to the system."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_release_gives_the_model_back_trained_and_frees_the_engine() -> None:
    """The memory the engine held is freed: malloc's bytes in use drop by it, less the model's own copy.
    (Not the resident memory: whether glibc gives pages back depends on what the process did before.)"""
    model, opt = _prepared(tiny_llama(n_embd=512, vocab=2048, n_layer=4), dtype="fp32")
    _train(model, opt, steps=1)
    want = model.state_dict()
    want_loss = model(**make_batch(128)).loss.detach()
    state = model._elixir
    held = _engine_bytes(state)
    before = _heap_in_use()

    er.release(model)

    assert not hasattr(model, "_elixir") and _unit_hooks(model) == 0 and not model._forward_pre_hooks
    assert _engine_bytes(state) == 0
    # the model's own copy (4 bytes per parameter) came back; the engine's 16 went
    assert before - _heap_in_use() > 0.9 * held - 4 * sum(p.numel() for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    torch.testing.assert_close(model(**make_batch(128)).loss, want_loss)  # a plain model again

    model, opt = _prepared(model)  # prepared again, from the trained weights
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    _train(model, opt, steps=1)
