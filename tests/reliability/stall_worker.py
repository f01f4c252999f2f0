"""A 2-rank ElixirTrainer job (run by ``torchrun`` in ``test_stalled_rank.py``) in which rank 1 stops
itself (SIGSTOP, as ctrl-Z or a debugger would) at ``argv[2]``: ``forward``, the start of step 3 (rank 0
waits in the forward's check-in), or ``save``, inside the optimizer save of ``checkpoint-2`` (rank 0
waits in the save's gather, a collective on the default group, whose ``--ddp_timeout`` is 120 s).
Lockstep timeout 3 s. Rank 0 writes its pid and its default group's gloo timeout to
``<argv[1]>/rank0.json`` when training starts; rank 1 marks ``<argv[1]>/stopping`` as it stops, and
leaves a process that kills it once rank 0 has ended (``torchrun`` would wait 30 s for a stopped rank
before it kills it)."""

from __future__ import annotations

import json
import os
import select
import signal
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_cases import make_trainer, training_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import elixir_hf.trainer  # noqa: E402

CONFIG = '{"mode": "static", "n_blocks": "min", "offload": 0.5, "lockstep_timeout_s": 3}'
DDP_TIMEOUT = 120


def stop(out: str) -> None:
    with open(os.path.join(out, "rank0.json")) as f:
        rank0 = json.load(f)["pid"]
    if os.fork() == 0:  # waits for rank 0's end (a pidfd), then kills its stopped parent
        select.select([os.pidfd_open(rank0)], [], [])
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(0)
    open(os.path.join(out, "stopping"), "w").close()
    os.kill(os.getpid(), signal.SIGSTOP)


class Report(TrainerCallback):
    def __init__(self, out: str, where: str) -> None:
        self.out, self.where = out, where

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            with open(os.path.join(self.out, "rank0.json"), "w") as f:
                json.dump({"pid": os.getpid(), "ddp_timeout_s": backend.options._timeout.total_seconds()}, f)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.where == "forward" and args.process_index == 1 and state.global_step == 2:
            stop(self.out)


def main(out: str, where: str) -> None:
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no")
    args = training_args(out, CONFIG, **args, ddp_backend="gloo", ddp_timeout=DDP_TIMEOUT)
    trainer = make_trainer("gpt2", args, n_train=64)
    trainer.add_callback(Report(out, where))
    if where == "save" and args.process_index == 1:
        save = elixir_hf.trainer.save_optimizer
        elixir_hf.trainer.save_optimizer = lambda *a, **kw: (stop(out), save(*a, **kw))[1]
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
