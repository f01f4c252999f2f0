"""A 1-rank ElixirTrainer run (6 steps, a checkpoint every 2, at most 1 kept) that SIGKILLs
itself during the save of ``checkpoint-4`` at the phase named by ``argv[2]``, as a crash or an
OOM kill would: ``test_checkpoint_faults.py`` then resumes from what is left."""

from __future__ import annotations

import os
import signal
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import transformers.trainer  # noqa: E402
from transformers import TrainerState  # noqa: E402

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402

VICTIM = "checkpoint-4"
# phase -> the file whose move into place is replaced by the kill (the temporary file is written)
RENAMES = {"weights": "model.safetensors", "shard": "elixir_optim_rank0.pt", "marker": "elixir_checkpoint.json"}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str) -> None:
    if phase in RENAMES:
        replace = os.replace

        def killing_replace(src, dst, *args, **kwargs):
            if VICTIM in str(dst) and os.path.basename(dst) == RENAMES[phase]:
                die()
            return replace(src, dst, *args, **kwargs)

        os.replace = killing_replace
    elif phase == "trainer_state":  # every Elixir file written, the Trainer's state not yet
        save = TrainerState.save_to_json
        TrainerState.save_to_json = lambda self, path: die() if VICTIM in path else save(self, path)
    elif phase == "rotation":  # after the marker, before older checkpoints are deleted
        rotate = transformers.trainer.rotate_checkpoints
        transformers.trainer.rotate_checkpoints = lambda **kw: die() if os.path.isdir(
            os.path.join(kw["output_dir"], VICTIM)) else rotate(**kw)
    else:
        raise SystemExit(f"unknown phase {phase!r}")


def trainer(out: str):
    args = dict(max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=1, eval_strategy="no")
    return make_trainer("gpt2", training_args(out, OFFLOAD_PLAN, **args), n_train=64)


if __name__ == "__main__":
    arm(sys.argv[2])
    trainer(sys.argv[1]).train()
    sys.exit(3)  # not killed: the phase was never reached
