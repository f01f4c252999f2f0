"""1-rank ElixirTrainer runs (6 steps, a checkpoint every 2, at most 1 kept) that SIGKILL
themselves during the save of ``checkpoint-4``, as a crash or an OOM kill would, one per phase
named in ``argv[2:]``, into ``<argv[1]>/<phase>``: ``test_checkpoint_faults.py`` then resumes
from what is left. Each run is a child forked after the imports (seconds saved per phase); the
exit status of each goes to ``<argv[1]>/status.json``."""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import transformers.trainer  # noqa: E402
from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402
from transformers import TrainerState  # noqa: E402

VICTIM = "checkpoint-4"
# phase -> the file whose move into place is replaced by the kill (the temporary file is written)
RENAMES = {
    "weights": "model.safetensors",
    "shard": "optimizer-00000-of-00001.safetensors",
    "marker": "elixir_checkpoint.json",
}


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
        transformers.trainer.rotate_checkpoints = lambda **kw: (
            die() if os.path.isdir(os.path.join(kw["output_dir"], VICTIM)) else rotate(**kw)
        )
    else:
        raise SystemExit(f"unknown phase {phase!r}")


def trainer(out: str):
    args = dict(max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=1, eval_strategy="no")
    return make_trainer("gpt2", training_args(out, OFFLOAD_PLAN, **args), n_train=64)


def main(out: str, phases: list[str]) -> None:
    status = {}
    for phase in phases:
        pid = os.fork()
        if pid == 0:
            arm(phase)
            trainer(os.path.join(out, phase)).train()
            os._exit(3)  # not killed: the phase was never reached
        status[phase] = os.waitpid(pid, 0)[1]
    with open(os.path.join(out, "status.json"), "w") as f:
        json.dump(
            {phase: os.WTERMSIG(s) if os.WIFSIGNALED(s) else -os.WEXITSTATUS(s) for phase, s in status.items()}, f
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
