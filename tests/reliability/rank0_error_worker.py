"""A 2-rank ElixirTrainer job (``run_ranks`` in ``test_checkpoint_faults.py``) whose rank 0 alone meets an
error: ``full``, the disk full as the Trainer writes ``checkpoint-2/trainer_state.json`` (a write of the
Trainer's own, on rank 0 only, after the save's collectives); ``read-only``, the output folder on a
read-only file system (``os.open`` there fails, as for a non-root user without write permission), met
first as rank 0 takes the folder's lock. Each rank writes what ``train()`` raised to ``OUT/rank<r>.json``.
``rank0_error_worker.py OUT full|read-only``."""

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


def read_only(run: str) -> None:
    """``os.open`` of any path under ``run`` fails with EROFS."""
    real = os.open

    def refused(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202 - os.open's own signature
        if os.path.abspath(path).startswith(run):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    os.open = refused


def main(out: str, fault: str) -> None:
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no", ddp_backend="gloo")
    run = os.path.join(out, "run")
    trainer = make_trainer("gpt2", training_args(run, OFFLOAD_PLAN, **args), n_train=32)
    if trainer.args.process_index == 0:
        if fault == "full":
            TrainerState.save_to_json = full_disk
        else:
            read_only(run)
    try:
        trainer.train()
        raised = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        raised = {"type": type(e).__name__, "message": str(e)}
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump(raised, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
