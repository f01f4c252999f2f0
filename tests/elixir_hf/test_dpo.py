"""TRL's ``DPOTrainer`` under Elixir: the reference model on an engine of frozen chunks
(``elixir_hf.reference.frozen_engine``), or TRL's precomputed reference log-probs run on the trained
model's engine. The losses, grad norms and DPO metrics of 3 steps equal the stock DPOTrainer's (fp32
on CPU, relative 1e-5), with the reference loaded by TRL (no ``ref_model``), given, precomputed, or
(a LoRA adapter) the trained model with its adapters off."""

from __future__ import annotations

import math

import pytest
import torch
import trl.trainer.dpo_trainer as dpo_module
from datasets import Dataset
from hf_cases import OFFLOAD_PLAN, history, save_tiny_lm
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from elixir_hf import ElixirSpecError, elixir_args, elixir_trainer
from elixir_hf.plugin import ElixirPlugin
from elixir_hf.reference import frozen_engine

RTOL = 1e-5
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")
STEPS = 3


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELIXIR_CONFIG", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _no_shared_precompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL caches precomputed log-probs by (dataset, model hash) in the process's temporary folder: each
    run gets a hash of its own, so no run reads another's."""
    monkeypatch.setattr(dpo_module, "hash_module", lambda module: f"run-{id(module)}")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(save_tiny_lm(tmp_path_factory.mktemp("tiny-llama"), arch="llama"))


def _dataset(tokenizer) -> Dataset:
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())

    def text(i: int, n: int) -> str:
        return " ".join(words[(7 * i + 3 * j) % len(words)] for j in range(n))

    return Dataset.from_dict(
        {
            "prompt": [text(i, 4) for i in range(8)],
            "chosen": [text(i + 1, 5) for i in range(8)],
            "rejected": [text(i + 2, 3) for i in range(8)],
        }
    )


def _dpo(
    llama_dir: str, out: str, elixir: str | None, ref: bool = False, precompute: bool = False, lora: bool = False
) -> DPOTrainer:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    settings = {
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "max_length": 16,
        "bf16": False,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
        "precompute_ref_log_probs": precompute,
    }
    if elixir is None:
        cls, args = DPOTrainer, DPOConfig(output_dir=out, **settings)
    else:
        cls, args = elixir_trainer(DPOTrainer), elixir_args(DPOConfig)(output_dir=out, elixir=elixir, **settings)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager")
    ref_model = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager") if ref else None
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], lora_dropout=0.0) if lora else None
    trainer = cls(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=_dataset(tokenizer),
        processing_class=tokenizer,
        peft_config=peft,
    )
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def stock(llama_dir, tmp_path_factory) -> DPOTrainer:
    return _dpo(llama_dir, str(tmp_path_factory.mktemp("stock")), None)


@pytest.mark.parametrize(
    ("ref", "precompute"),
    [(False, False), (True, False), (False, True)],
    ids=["trl-loads-ref", "ref-given", "precompute"],
)
def test_dpo_losses_are_the_stock_ones(
    llama_dir, tmp_path, monkeypatch: pytest.MonkeyPatch, stock, ref: bool, precompute: bool
) -> None:
    on_engine = []  # each reference forward: whether the model it ran had an engine
    stock_ref = DPOTrainer.compute_ref_log_probs

    def spied(self, model, inputs):
        on_engine.append(hasattr(model, "_elixir"))
        return stock_ref(self, model, inputs)

    monkeypatch.setattr(DPOTrainer, "compute_ref_log_probs", spied)
    ours = _dpo(llama_dir, str(tmp_path), OFFLOAD_PLAN, ref=ref, precompute=precompute)
    for key in KEYS:
        got, want = history(ours, key), history(stock, key)
        assert len(got) == len(want) == STEPS, (key, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=1e-6), f"{key}[{i}]: elixir {g} vs stock {w}"
    assert history(ours, "loss")[0] == pytest.approx(math.log(2), rel=1e-6)  # reference = the starting policy
    assert history(ours, "rewards/margins")[-1] != 0  # the policy moved away from the reference
    if precompute:  # TRL ran the trained model as the reference in __init__: on its engine, built first
        assert ours.ref_model is None and on_engine and all(on_engine), on_engine
    else:
        elixir = ours.ref_model._elixir
        assert not any(c.trainable for c in elixir.plan.chunks)  # frozen chunks: no gradient, no Adam state
        assert len(elixir.plan.offload) == len(elixir.plan.chunks)  # reference_offload 1.0: all in host memory
        assert ours.ref_model._elixir is not ours.model._elixir


def test_dpo_with_a_lora_adapter_is_the_stock_one(llama_dir, tmp_path) -> None:
    """No reference model: TRL runs the trained model with its adapters off, on the one engine."""
    stock = _dpo(llama_dir, str(tmp_path / "stock"), None, lora=True)
    ours = _dpo(llama_dir, str(tmp_path / "elixir"), OFFLOAD_PLAN, lora=True)
    assert ours.ref_model is None
    for key in KEYS:
        got, want = history(ours, key), history(stock, key)
        assert len(got) == len(want) == STEPS and all(
            math.isclose(g, w, rel_tol=RTOL, abs_tol=1e-6) for g, w in zip(got, want)
        ), (key, got, want)
    assert history(ours, "rewards/margins")[-1] != 0


def test_the_reference_holds_compute_dtype_weights_only(llama_dir) -> None:
    """bf16 weights, 2 bytes a parameter (padding aside): no master copy, no gradient, no moments."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.tensor([[4, 9, 17, 30, 41, 7]])
    with torch.no_grad():
        want = model.to(torch.bfloat16)(input_ids=ids).logits.float()
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    plugin = ElixirPlugin.from_spec('{"reference_offload": 0.5}')
    assert plugin is not None
    plugin.resolve_dtype("bf16")
    frozen_engine(model, plugin, torch.device("cpu"))
    plan = model._elixir.plan
    assert 2 * n <= plan.memory.host_shards + plan.memory.device_shards < 2.5 * n
    assert 0 < len(plan.offload) < len(plan.chunks)
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


def test_sync_ref_model_is_refused_at_parsing(tmp_path) -> None:
    with pytest.raises(ElixirSpecError, match=r"--sync_ref_model true is not supported with Elixir.*drop --sync_ref"):
        elixir_args(DPOConfig)(output_dir=str(tmp_path), elixir="auto", use_cpu=True, sync_ref_model=True)


@pytest.mark.parametrize("value", [1.5, -0.1, "all", True])
def test_reference_offload_is_checked(value) -> None:
    with pytest.raises(ElixirSpecError, match=r"reference_offload must be a fraction in \[0, 1\]"):
        ElixirPlugin.from_spec({"reference_offload": value})
