"""A 2-rank ElixirTrainer job (``run_ranks`` in ``test_checkpoint_faults.py``) whose rank 0 finds the disk
full as the Trainer writes ``checkpoint-2/trainer_state.json`` (a write of the Trainer's own, on rank 0
only, after the save's collectives). Each rank writes what ``train()`` raised to ``OUT/rank<r>.json``.
``rank0_error_worker.py OUT``."""

from __future__ import annotations

import errno
import json
import os
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402
from transformers import TrainerState  # noqa: E402


def full_disk(self, json_path: str) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), json_path)


def main(out: str) -> None:
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no", ddp_backend="gloo")
    trainer = make_trainer("gpt2", training_args(os.path.join(out, "run"), OFFLOAD_PLAN, **args), n_train=32)
    if trainer.args.process_index == 0:
        TrainerState.save_to_json = full_disk
    try:
        trainer.train()
        raised = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        raised = {"type": type(e).__name__, "message": str(e)}
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump(raised, f)


if __name__ == "__main__":
    main(sys.argv[1])
