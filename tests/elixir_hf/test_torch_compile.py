"""``--torch_compile`` under ElixirTrainer: the engine compiles each decoder layer's forward
(``elixir_runtime.compile_blocks``) instead of Accelerate compiling the whole model through the
chunk hooks. With AOTAutograd's eager backend (no C++ build on the CPU) the logged losses and grad
norms are the eager Elixir run's exactly; the compile time, graphs and graph breaks are logged as
``elixir/compile_*``; what cannot work (CUDA graphs) is refused when the arguments are parsed."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hf_cases import history, make_trainer, training_args

from elixir_hf import ElixirSpecError
from elixir_runtime.runtime import state as engine_state


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ELIXIR_CONFIG", raising=False)
    monkeypatch.setattr(engine_state, "CHECKING", False)  # with the state checks, every forward runs eagerly
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with mock.patch.dict(os.environ):  # TrainingArguments exports ACCELERATE_DYNAMO_* for the Accelerator
        yield


def test_compiled_layers_log_the_eager_runs_losses(tmp_path) -> None:
    settings = dict(max_steps=6, eval_strategy="no")
    eager = make_trainer("llama", training_args(str(tmp_path / "eager"), "auto", **settings))
    eager.train()
    compiled = make_trainer(
        "llama",
        training_args(str(tmp_path / "compiled"), "auto", torch_compile_backend="aot_eager", **settings),
    )
    assert compiled.args.torch_compile
    compiled.train()
    for key in ("loss", "grad_norm"):
        assert history(compiled, key) == history(eager, key), key
    layers = compiled.model.model.layers
    assert all("forward" in layer.__dict__ for layer in layers)  # compiled on the instance, hooks outside
    logged = [h for h in compiled.state.log_history if "elixir/compile_graphs" in h]
    assert logged and logged[-1]["elixir/compile_graphs"] == 1 and logged[-1]["elixir/compile_graph_breaks"] == 0
    assert not any("elixir/compile_graphs" in h for h in eager.state.log_history)


def test_a_graph_break_is_told_once(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A kernel dynamo cannot trace (Liger's, on a GPU) breaks each compiled layer: the run says so, once."""
    from transformers.models.llama import modeling_llama

    layer_forward = modeling_llama.LlamaDecoderLayer.forward

    def untraceable(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return layer_forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", untraceable)
    args = training_args(str(tmp_path), "auto", torch_compile_backend="aot_eager", max_steps=4, logging_steps=1)
    with caplog.at_level("WARNING", logger="elixir_hf.metrics"):
        make_trainer("llama", args).train()
    told = [r.getMessage() for r in caplog.records if "torch.compile broke" in r.getMessage()]
    assert len(told) == 1 and "graph_break" in told[0].lower(), told


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_at_parse_time(tmp_path, mode: str) -> None:
    with pytest.raises(ElixirSpecError, match=rf"--torch_compile_mode.*mode='{mode}' uses CUDA graphs"):
        training_args(str(tmp_path), "auto", torch_compile_mode=mode)
