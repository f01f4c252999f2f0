"""Generating while training: ``GenerateCallback`` in the Trainer and ``accelerator.full_params``
with ``unwrap_model(model).generate`` give what a plain model with the same weights generates.
(Two ranks, rank 0 generating alone: ``dist_worker.py`` and ``tests/reliability``.)"""

from __future__ import annotations

import torch
from hf_cases import OFFLOAD_PLAN, VOCAB, TokenDataset, make_trainer, training_args
from transformers import default_data_collator

from elixir_hf import ElixirAccelerator, GenerateCallback
from helpers.models import tiny_gpt2

PROMPT = torch.tensor([[5, 17, 3, 9], [8, 8, 40, 2]])
GENERATE = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)


def _plain_generate(state: dict) -> torch.Tensor:
    plain = tiny_gpt2(vocab=VOCAB).eval()
    plain.load_state_dict(state)
    return plain.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **GENERATE)


def test_generate_callback_samples_on_the_main_process_during_training(tmp_path) -> None:
    trainer = make_trainer("gpt2", training_args(str(tmp_path), OFFLOAD_PLAN, max_steps=4, eval_strategy="no"))
    callback = GenerateCallback(
        {"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT)}, every_n_steps=2, **GENERATE
    )
    trainer.add_callback(callback)
    trainer.train()
    assert [step for step, _ in callback.samples] == [2, 4]
    assert trainer.model.training  # the callback put the model back in training mode
    assert torch.equal(callback.samples[-1][1], _plain_generate(trainer.model.state_dict()))


def test_accelerator_full_params_with_unwrap_model_generate() -> None:
    accelerator = ElixirAccelerator(cpu=True, elixir_plugin=OFFLOAD_PLAN)
    model = tiny_gpt2(vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenDataset(4), batch_size=2, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with accelerator.full_params(model):
        assert accelerator.unwrap_model(model) is model
        if accelerator.is_main_process:
            out = accelerator.unwrap_model(model).generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **GENERATE)
    assert torch.equal(out, _plain_generate(accelerator.get_state_dict(model)))
