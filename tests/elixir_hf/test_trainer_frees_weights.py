"""The Trainer path frees the model's host copy of its weights once the engine holds them: nothing
the Trainer keeps (the model, its optimizer, the accelerator) holds the original storages, so the
planner's count of what they free (``elixir_runtime.host``) is what the run gets."""

from __future__ import annotations

import gc
import weakref

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args


def test_the_trainer_lets_the_weights_go(tmp_path) -> None:
    trainer = make_trainer("llama", training_args(str(tmp_path), elixir=OFFLOAD_PLAN, max_steps=1))
    refs = [weakref.ref(p.untyped_storage()) for p in trainer.model.parameters()]
    trainer.create_optimizer()
    gc.collect()
    assert trainer.model._elixir.plan.offload and all(r() is None for r in refs)
    trainer.train()  # and it trains on the chunks
    assert trainer.state.global_step == 1
