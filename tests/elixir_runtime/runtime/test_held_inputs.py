"""Held block inputs in host memory (``elixir_runtime/runtime/held_inputs.py``): a run with the plan's
activations on the host trains bit for bit as one with them on the device, each block's input goes out
once in the forward and comes back ahead of its recompute (recorded events), and the profiler counts
the same tensors the engine moves."""

from __future__ import annotations

import pytest
import torch

import elixir_runtime as er
from elixir_runtime.profiler.profile import profile_model
from elixir_runtime.runtime.held_inputs import LOOKAHEAD, HeldInputs
from helpers.models import make_batch, tiny_llama
from helpers.training import Recipe, max_weight_diff, run_elixir, run_reference

N_LAYER = 6


@pytest.mark.parametrize(
    ("plan", "reentrant"),
    [(dict(n_blocks="min", offload=0.5), False), (dict(), False), (dict(), True)],
    ids=["offload", "on-device", "reentrant"],
)
def test_host_activations_train_as_device_ones(plan: dict, reentrant: bool) -> None:
    recipe = Recipe(model="llama", steps=4, ac=reentrant, grad_accum=2)
    host = run_elixir(recipe, activations="host", **plan)
    device = run_elixir(recipe, activations="device", **plan)
    assert host.losses == device.losses
    assert max_weight_diff(host.state, device.state) == 0.0
    ref = run_reference(recipe)
    assert max_weight_diff(host.state, ref.state) < 1e-5


class _Recorded(HeldInputs):
    """Records each held input's way: ``("out", i)`` in the forward, ``("fetch", i)`` and ``("use", i)``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.events: list[tuple[str, int]] = []
        self.ids: dict[int, int] = {}

    def pack(self, t):  # type: ignore[no-untyped-def]
        h = super().pack(t)
        if h is not None:
            self.ids[id(h)] = len(self.ids)
            self.events.append(("out", self.ids[id(h)]))
        return h

    def _fetch(self, h):  # type: ignore[no-untyped-def]
        self.events.append(("fetch", self.ids[id(h)]))
        super()._fetch(h)

    def unpack(self, h):  # type: ignore[no-untyped-def]
        self.events.append(("use", self.ids[id(h)]))
        return super().unpack(h)


def _prepared(**config: object) -> tuple[torch.nn.Module, er.ElixirOptimizer]:
    model = tiny_llama(n_layer=N_LAYER)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = er.ElixirConfig(mode="static", device="cpu", **config)  # type: ignore[arg-type]
    return er.prepare(model, opt, config=cfg, example_batch=make_batch(128, device=torch.device("cpu")))


def test_each_input_goes_out_once_and_comes_back_ahead_of_its_recompute() -> None:
    model, opt = _prepared(activations="host")
    recorded = _Recorded(torch.device("cpu"))
    model._elixir.hooks.root.held = recorded
    for _, unit in model._elixir.hooks.units:
        unit.held = recorded
    opt.backward(model(**make_batch(128, device=torch.device("cpu"))).loss)
    events = recorded.events
    outs = [i for kind, i in events if kind == "out"]
    uses = [i for kind, i in events if kind == "use"]
    assert outs[:N_LAYER] == list(range(N_LAYER))  # every block's input, in the forward, before any comes back
    assert all(kind == "out" for kind, _ in events[: len(outs)])
    assert sorted(uses) == outs  # each one read once, by its recompute
    assert uses[-N_LAYER:] == list(range(N_LAYER))[::-1]  # newest first, as the backward goes
    for i in uses:  # each came back before it was read, and the next one was on its way
        use = events.index(("use", i))
        assert events.index(("fetch", i)) < use
        if i > 0 and i in range(N_LAYER):
            assert events.index(("fetch", i - 1)) < use
    fetched_ahead = max(
        sum(1 for kind, j in events[:k] if kind == "fetch") - sum(1 for kind, j in events[:k] if kind == "use")
        for k in range(len(events))
    )
    assert fetched_ahead <= LOOKAHEAD  # on the GPU at once: the one in use and LOOKAHEAD coming
    assert not [r for r in recorded.held if r() is not None]  # nothing left behind


def test_the_profile_counts_the_inputs_the_engine_moves() -> None:
    """The held bytes are one ``batch x seq x hidden`` input per block (replayed from three traced blocks
    as traced all), and the peak with them on the host keeps ``LOOKAHEAD + 1`` of them."""
    model = tiny_llama(n_layer=N_LAYER, n_embd=64, n_positions=256)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(128, batch=2, seq=128, device=torch.device("cpu"))
    one = 2 * 128 * 64 * 2  # bf16
    replayed = profile_model(model, batch, dtype=torch.bfloat16, device="cpu")
    traced = profile_model(model, batch, dtype=torch.bfloat16, device="cpu", exact=True)
    for p in (replayed, traced):
        assert p.held_inputs == N_LAYER * one
        assert p.host_activation_peak <= p.activation_peak - (N_LAYER - LOOKAHEAD - 1) * one
        assert p.host_activation_peak >= p.activation_peak - N_LAYER * one
    assert replayed.host_activation_peak == traced.host_activation_peak
    no_ac = profile_model(tiny_llama(n_layer=N_LAYER), make_batch(128), dtype=torch.float32, device="cpu")
    assert no_ac.held_inputs == 0 and no_ac.host_activation_peak == no_ac.activation_peak


@pytest.mark.gpu
def test_on_a_gpu_the_held_inputs_leave_its_memory() -> None:
    """A 16k-token step of an 8-block Llama: at the end of the forward the host plan keeps at most the
    ``LOOKAHEAD + 1`` newest of the held inputs on the GPU where the device plan keeps them all (the profile's
    ``held_inputs``), and the steps train as the device plan's do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        max_position_embeddings=16384,
        use_cache=False,
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (1, 16384), generator=gen).cuda()
    batch = {"input_ids": ids, "labels": ids}
    held: dict[str, int] = {}
    losses: dict[str, list[float]] = {}
    for where in ("device", "host"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        profile = profile_model(model, batch, dtype=torch.bfloat16, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cfg = er.ElixirConfig(mode="static", activations=where)  # type: ignore[arg-type]
        model, opt = er.prepare(model, opt, config=cfg, example_batch=batch)
        for _step in range(2):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            loss = model(**batch).loss
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # the allocator frees what the finished copies held (record_stream)
            held[where] = torch.cuda.memory_allocated() - base
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.setdefault(where, []).append(loss.item())
        er.release(model)
        del model, opt
    one = profile.held_inputs // 8
    print(f"left on the GPU by the forward {held}; held inputs {profile.held_inputs} (one {one}); losses {losses}")
    assert profile.held_inputs == 8 * 16384 * 2048 * 2
    # at most two more go than the blocks': the final norm's and the head's inputs, units that save what they were handed
    assert (8 - LOOKAHEAD - 1) * one <= held["device"] - held["host"] <= (8 + 2) * one
    assert losses["host"][0] == losses["device"][0]
    # the second step's differs by CUDA's nondeterministic backward kernels (atomics) alone; bitwise on the CPU
    assert losses["host"][1] == pytest.approx(losses["device"][1], rel=1e-3)
