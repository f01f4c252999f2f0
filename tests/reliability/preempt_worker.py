"""A 2-rank ElixirTrainer job (run by ``torchrun`` in ``test_preemption.py``): the straight run (6 steps,
saving ``<argv[1]>/straight/checkpoint-3`` and ``-6``), then the same run in ``<argv[1]>/preempted`` in which rank 1
alone gets SIGTERM as step 3 begins. Each rank writes the status it exits with to
``<argv[1]>/rank<r>.json`` and waits for the other's before exiting (``torchrun`` stops the other
ranks once one exits). Also imported by the test for ``SignalAt``."""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import torch.distributed as dist  # noqa: E402
from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class SignalAt(TrainerCallback):
    """Sends ``signum`` to this process as step ``step`` begins (on rank ``rank`` only, if given)."""

    def __init__(self, step: int, signum: int, rank: int | None = None) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and self.rank in (None, args.process_index):
            os.kill(os.getpid(), self.signum)


def main(out: str) -> None:
    def trainer(folder: str):
        args = dict(max_steps=6, save_strategy="steps", save_steps=3, eval_strategy="no")
        args = training_args(os.path.join(out, folder), OFFLOAD_PLAN, **args, ddp_backend="gloo", ddp_timeout=120)
        return make_trainer("gpt2", args, n_train=64)

    trainer("straight").train()
    preempted = trainer("preempted")
    preempted.add_callback(SignalAt(step=3, signum=signal.SIGTERM, rank=1))
    try:
        preempted.train()
    except SystemExit as stop:
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"exit": stop.code}, f)
        dist.barrier()
        raise


if __name__ == "__main__":
    main(sys.argv[1])
