"""An ElixirTrainer job (run by ``test_preemption.py`` in a process group of its own: 1 rank, or 2 gloo
ranks by ``run_ranks``) that loads its batches with 2 DataLoader workers; as step 3 begins, rank
``RANK`` has ``SIGNAL`` sent to the whole process group, as SLURM's preemption or ``scancel`` would:
every rank and every worker gets it, from a process that is none's parent (torch's worker handler
exits quietly on its parent's SIGTERM). Each rank writes the status it exits with and whether it was preempted
to ``OUT/rank<r>.json``.

``group_signal_worker.py OUT SIGNAL RANK``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class SignalGroupAt(TrainerCallback):
    """Has ``signum`` sent to this process's group as step ``step`` begins, on rank ``rank``, by a process
    of its own (itself in the group): once it has ended, every process of the group has the signal."""

    def __init__(self, step: int, signum: int, rank: int) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and args.process_index == self.rank:
            kill = f"import os; os.killpg({os.getpgrp()}, {self.signum})"
            subprocess.run([sys.executable, "-c", kill], check=False)


def main(out: str, signum: int, rank: int) -> None:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    args = dict(max_steps=6, save_strategy="steps", save_steps=5, eval_strategy="no", dataloader_num_workers=2)
    if ranks > 1:
        args.update(ddp_backend="gloo", ddp_timeout=120)
    trainer = make_trainer("gpt2", training_args(os.path.join(out, "run"), OFFLOAD_PLAN, **args), n_train=64)
    trainer.add_callback(SignalGroupAt(step=3, signum=signum, rank=rank))
    try:
        trainer.train()
        code = 0
    except SystemExit as stop:
        code = stop.code
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump({"exit": code, "step": trainer.state.global_step}, f)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], signal.Signals[sys.argv[2]].value, int(sys.argv[3]))
