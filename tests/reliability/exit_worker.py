"""A ``run_clm.py``-style job (train, save, return) run by ``torchrun`` in ``test_clean_exit_trainer.py``:
it ends the way a user's script does, by returning from ``main`` (no ``destroy_process_group``,
no ``os._exit``), so whatever the engine leaves running at interpreter exit shows here."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402


def main(out: str) -> None:
    args = training_args(
        out,
        OFFLOAD_PLAN,
        max_steps=4,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=2,
        ddp_backend="gloo",
        ddp_timeout=120,
        logging_steps=2,
    )
    trainer = make_trainer("gpt2", args, n_train=64)
    trainer.train()
    trainer.save_model(f"{out}/final")


if __name__ == "__main__":
    main(sys.argv[1])
