"""The fake-tensor profile against real runs of tiny models (CPU, seconds).

Param order and checkpointed regions are compared with what a real forward does; the activation
accounting with what the model must keep alive; block replay with the full trace.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves

from elixir_runtime.profiler import ModelProfile, profile_model
from helpers.models import MODEL_BUILDERS, make_batch, make_mlp_batch, preset_on_meta, tiny_gpt2, tiny_mlp

VOCAB = 128


class _FirstUse(TorchDispatchMode):
    """Records the names of parameters in the order real ops first touch them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.order: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in arg_tree_leaves(*args, **(kwargs or {})):
            name = self.names.get(id(t))
            if name is not None and name not in self.order:
                self.order.append(name)
        return func(*args, **(kwargs or {}))


def _real_order(model: nn.Module, batch: dict) -> list[str]:
    recorder = _FirstUse(model)
    model.train()
    with recorder:
        model(**batch)
    return recorder.order


def _build(kind: str, ac: bool, n_layer: int = 6) -> nn.Module:
    model = MODEL_BUILDERS[kind](n_layer=n_layer)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama"])
def test_param_order_matches_the_real_forward(kind: str, ac: bool) -> None:
    model = _build(kind, ac)
    batch = make_batch(VOCAB)
    profile = profile_model(model, batch, device="cpu")
    used = [p.name for p in profile.params if p.used]
    assert used == _real_order(model, batch)
    assert profile.blocks is not None  # 6 identical blocks: 3 traced, 3 replayed


def test_param_order_of_a_plain_module() -> None:
    model = tiny_mlp(n_layers=3, unused_branch=True)
    batch = make_mlp_batch()
    profile = profile_model(model, batch, device="cpu")
    assert [p.name for p in profile.params if p.used] == _real_order(model, batch)
    assert [p.name for p in profile.params if not p.used] == ["unused.weight", "unused.bias"]


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama"])
def test_checkpointed_regions_are_the_blocks(kind: str) -> None:
    model = _build(kind, ac=True)
    profile = profile_model(model, make_batch(VOCAB), device="cpu")
    stack = profile.blocks.prefix
    blocks = model.get_submodule(stack)
    assert [r.name for r in profile.ac_regions] == [f"{stack}.{i}" for i in range(len(blocks))]
    for i, region in enumerate(profile.ac_regions):
        expected = [f"{stack}.{i}.{n}" for n, _ in blocks[i].named_parameters()]
        assert sorted(region.params) == sorted(expected)
    numel = sum(p.numel() for p in blocks[0].parameters())
    assert profile.ac_buffer_numel() == numel


def test_regions_of_torch_utils_checkpoint_in_a_plain_module() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            x = torch.utils.checkpoint.checkpoint(lambda y: self.b(self.a(y).relu()), x, use_reentrant=False)
            return self.c(x).sum()

    profile = profile_model(Net(), (torch.randn(3, 4),), device="cpu")
    assert len(profile.ac_regions) == 1
    assert profile.ac_regions[0].params == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert torch.utils.checkpoint.checkpoint.__name__ == "checkpoint"  # restored


@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama"])
def test_block_replay_equals_the_full_trace(kind: str, ac: bool) -> None:
    model = _build(kind, ac, n_layer=7)
    batch = make_batch(VOCAB, batch=3, seq=12)
    fast = profile_model(model, batch, device="cpu")
    full = profile_model(model, batch, device="cpu", exact=True)
    assert fast.blocks is not None and full.blocks is None
    for field in ("activation_peak", "forward_peak", "saved_bytes", "compute", "params", "unit_events", "ac_regions"):
        assert getattr(fast, field) == getattr(full, field), field


def test_checkpointing_keeps_one_hidden_state_per_block() -> None:
    """Under AC what a block leaves for backward is its input: B x S x hidden (fp32 here)."""
    batch = make_batch(VOCAB, batch=2, seq=16)
    saved = [profile_model(_build("gpt2", ac=True, n_layer=n), batch, device="cpu").saved_bytes for n in (5, 7)]
    assert saved[1] - saved[0] == 2 * (2 * 16 * 32 * 4)


def test_checkpointing_lowers_the_peak_and_the_peak_grows_with_the_batch() -> None:
    small, large = make_batch(VOCAB, batch=2, seq=16), make_batch(VOCAB, batch=8, seq=16)
    off = profile_model(_build("gpt2", ac=False), large, device="cpu").activation_peak
    on = profile_model(_build("gpt2", ac=True), large, device="cpu").activation_peak
    assert on < off
    assert profile_model(_build("gpt2", ac=False), small, device="cpu").activation_peak < off


def test_gpu_attention_kernels_without_a_gpu() -> None:
    """With dropout, CPU SDPA materialises the scores; the CUDA plan must not count them."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    batch = make_batch(VOCAB, batch=2, seq=64)
    cpu = profile_model(model, batch, device="cpu")
    cuda = profile_model(model, batch, device="cuda")
    assert "attention:64" in cuda.compute["fwd"].flops  # the CUDA kernel, priced by its 64 keys
    assert cuda.activation_peak < cpu.activation_peak


def test_flash_attentions_backward_holds_its_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of CUDA's flash kernel allocates an fp32 query-gradient accumulator and the rows'
    softmax-gradient dot products beside its outputs ([Note: fused attention's workspace]): the
    profile's peak holds them, rows rounded up to 128 and the head dim to 32."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 3 * 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 200, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()

    batch = (torch.randn(2, 200, 64, dtype=torch.bfloat16),)
    model = Attention().to(torch.bfloat16)
    priced = profile_model(model, batch, device="cuda").activation_peak
    monkeypatch.setattr("elixir_runtime.profiler.recorder.workspace_bytes", lambda *_: 0)
    bare = profile_model(model, batch, device="cuda").activation_peak
    assert priced - bare == 4 * 2 * 4 * 256 * (32 + 1)


def test_tied_weights_buffers_and_sizes() -> None:
    model = tiny_gpt2(n_layer=2)
    profile = profile_model(model, make_batch(VOCAB), device="cpu")
    tied = {p.name: p.aliases for p in profile.params if p.aliases}
    assert tied == {"transformer.wte.weight": ["lm_head.weight"]}
    assert profile.n_params == sum(p.numel() for p in model.parameters())
    assert profile.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    assert profile.unit_order()[0] == "transformer.wte"


def test_profile_leaves_the_model_untouched() -> None:
    model = _build("gpt2", ac=True)
    model.eval()
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in params.items()}
    fn = model.transformer.h[0]._gradient_checkpointing_func
    profile_model(model, make_batch(VOCAB), device="cpu")
    assert not model.training and not any(m.training for m in model.modules())
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(torch.equal(before[n], p) and p.grad is None for n, p in params.items())
    assert model.transformer.h[0]._gradient_checkpointing_func is fn


def test_meta_model_and_json_round_trip() -> None:
    with torch.device("meta"):
        model = tiny_gpt2(n_layer=5)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    profile = profile_model(model, {"input_ids": ids, "labels": ids}, device="cpu")
    assert profile.activation_peak > 0
    assert ModelProfile.from_json(profile.to_json()) == profile


def _opt_175b_profile() -> tuple[ModelProfile, float]:
    start = time.perf_counter()
    model = preset_on_meta("opt-175b")
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    profile = profile_model(model, {"input_ids": ids, "labels": ids}, device="cuda")
    return profile, time.perf_counter() - start


def test_opt_175b_profiles_on_meta_with_block_replay() -> None:
    profile, _ = _opt_175b_profile()
    assert abs(profile.n_params - 174.6e9) < 0.1e9
    assert len(profile.ac_regions) == 96 and profile.blocks.total == 96 and profile.blocks.profiled == 3


@pytest.mark.perf
def test_opt_175b_profiles_in_5_seconds() -> None:
    profile, total = _opt_175b_profile()
    assert profile.seconds < 5 and total < 10, (profile.seconds, total)


def test_a_forward_that_needs_every_block_is_traced_in_full() -> None:
    class Stack(nn.Module):
        def __init__(self, n: int = 6) -> None:
            super().__init__()
            self.n = n
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

        def forward(self, x):
            for i in range(self.n):  # indexes by its own count: a cut stack raises IndexError
                x = self.blocks[i](x).relu()
            return x.sum()

    model = Stack()
    profile = profile_model(model, (torch.randn(4, 8),), device="cpu")
    assert profile.blocks is None
    assert [p.name for p in profile.params] == [n for n, _ in model.named_parameters()]


def test_late_peak_and_head_params_of_a_large_vocabulary_llama() -> None:
    """The loss's logits dominate the activation peak; once backward is past the head only the
    blocks' checkpoints and one block's recomputation are live (what the GPU's gradient shards
    share memory with, ``search/memory.py``). The head's parameters are named."""
    from helpers.models import tiny_llama

    model = tiny_llama(n_layer=4, n_embd=32, vocab=4096)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    profile = profile_model(model, make_batch(4096, batch=4, seq=64), device="cpu")
    assert profile.peak_at == "backward of the loss and head"
    assert profile.late_peak is not None and profile.late_peak < profile.activation_peak / 2
    logits = 4 * 64 * 4096 * 4  # fp32: the run frees them with the loss's backward, and so must the trace
    assert profile.late_peak < logits
    assert set(profile.head_params) == {"model.norm.weight", "lm_head.weight"}
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_backward_segments_name_each_gradient_once_and_free_a_checkpoint_per_block() -> None:
    """``ModelProfile.backward``: the head, the blocks last to first, then the embeddings; each
    trainable parameter's gradient arrives in exactly one segment, and under AC each block's
    backward frees its checkpoint, so the peaks fall block by block (what lets the GPU's gradient
    shards take the freed memory as they arrive, ``search/memory.py``)."""
    from helpers.models import tiny_llama

    model = tiny_llama(n_layer=4, n_embd=32, vocab=4096)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    profile = profile_model(model, make_batch(4096, batch=4, seq=64), device="cpu")
    named = [n for b in profile.backward for n in b.params]
    assert sorted(named) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert [b.params[0].split(".")[:3] for b in profile.backward[1:5]] == [
        ["model", "layers", str(i)] for i in (3, 2, 1, 0)
    ]
    assert profile.backward[-1].params == ["model.embed_tokens.weight"]
    peaks = [b.peak for b in profile.backward]
    assert (
        peaks[0] == profile.activation_peak and peaks[1:5] == sorted(peaks[1:5], reverse=True) and peaks[4] < peaks[1]
    )
    assert profile.late_peak == peaks[1]
