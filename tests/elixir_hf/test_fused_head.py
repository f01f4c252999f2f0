"""TRL's fused LM head on a model whose head is not tied to its embeddings (Llama): the stock
``SFTTrainer`` patches the model's forward (``trl.trainer.utils.add_fused_lm_head``) to read
``lm_head.weight`` without calling ``lm_head``, so the engine must have that weight gathered by
itself (``elixir_hf.engine.read_outside_modules``: a private chunk the model's forward gathers).
Unfixed, the loss stays at ln(vocab) and nothing trains, silently; here the losses and grad norms
are the stock SFTTrainer's (fp32 on CPU, relative 1e-5) and the weights move."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from hf_cases import OFFLOAD_PLAN, VOCAB, history, save_tiny_lm
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from elixir_hf import elixir_args, elixir_trainer
from elixir_hf.engine import read_outside_modules, whole_model

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELIXIR_CONFIG", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(save_tiny_lm(tmp_path_factory.mktemp("tiny-llama"), arch="llama"))


def _sft(llama_dir: str, out: str, elixir: str | None, lora: bool) -> SFTTrainer:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
    dataset = Dataset.from_dict(
        {"text": [" ".join(words[(5 * i + 3 * j) % len(words)] for j in range(12)) for i in range(16)]}
    )
    settings = {
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "adam_epsilon": 1e-6,
        "logging_steps": 1,
        "max_length": 16,
        "bf16": False,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
    }
    if elixir is None:
        cls, args = SFTTrainer, SFTConfig(output_dir=out, **settings)
    else:
        cls, args = elixir_trainer(SFTTrainer), elixir_args(SFTConfig)(output_dir=out, elixir=elixir, **settings)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight  # untied
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], lora_dropout=0.0) if lora else None
    trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft)
    trainer.train()
    return trainer


def _trained(trainer: SFTTrainer, lora: bool) -> dict[str, torch.Tensor]:
    """The weights that must move: the head (full fine-tune) or the adapters' B (LoRA, zero at start)."""
    model = trainer.model
    with torch.no_grad(), whole_model(model):
        return {
            n: p.detach().clone() for n, p in model.named_parameters() if ("lora_B" in n if lora else "lm_head" in n)
        }


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_stock_sft_trainer_trains_an_untied_head(llama_dir, tmp_path, lora: bool) -> None:
    stock = _sft(llama_dir, str(tmp_path / "stock"), None, lora)
    ours = _sft(llama_dir, str(tmp_path / "elixir"), OFFLOAD_PLAN, lora)
    # the head has a private chunk of its own, gathered by the model's forward and counted in the plan
    plan, live, head = ours.model._elixir.plan, ours.model._elixir.live, ours.model.get_output_embeddings().weight
    table = live.param_table
    i = table.index[id(head)]
    assert table.resident[i] and table.private[i] and live.root_chunks == (live.layout.param_chunk[i],)
    assert live.layout.chunks[live.root_chunks[0]].private and plan.memory.private >= head.numel() * 4  # fp32
    for key in ("loss", "grad_norm"):
        got, want = history(ours, key), history(stock, key)
        assert len(got) == len(want) == 4, (key, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert math.isclose(g, w, rel_tol=RTOL), f"{key}[{i}]: elixir {g} vs stock {w}"
    # the bug's signature: uniform logits (loss ln(vocab)) and no gradient
    assert abs(history(ours, "loss")[0] - math.log(VOCAB)) > 1e-3 and min(history(ours, "grad_norm")) > 0

    got, want = _trained(ours, lora), _trained(stock, lora)
    assert got and got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
        if lora:
            assert got[name].abs().max() > 0, name  # LoRA B starts at zero
    if not lora:
        start = AutoModelForCausalLM.from_pretrained(llama_dir).lm_head.weight
        assert not torch.allclose(got["lm_head.weight"], start)


def test_the_fused_forward_is_recognised(llama_dir) -> None:
    """TRL's ``_fused_forward`` carries the model class's ``forward`` name and signature
    (``functools.wraps``): only its own signature tells it apart."""
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert read_outside_modules(model) == []
    add_fused_lm_head(model)
    assert read_outside_modules(model) == [model.lm_head.weight]


def test_a_plan_file_made_without_the_fused_head_is_refused_naming_it(llama_dir, tmp_path) -> None:
    """A plan file (elixir-plan's) packs the head with other parameters; the SFT run gives it a chunk
    of its own, so the file's layout does not fit: an error naming the head and the cause."""
    import elixir_runtime as er
    from elixir_hf import ElixirSpecError

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    er.prepare(model, torch.optim.AdamW(model.parameters()), er.ElixirConfig(mode="static", chunk_size=16384))
    plan = tmp_path / "plan.json"
    plan.write_text(model._elixir.plan.to_json())
    with pytest.raises(
        ElixirSpecError, match=r"\['lm_head.weight'\] have chunks of their own because the forward reads"
    ):
        _sft(llama_dir, str(tmp_path / "out"), str(plan), lora=False)
