"""ElixirTrainer jobs (``run_ranks`` in ``test_rank_faults.py``, on the CPU or a GPU each) in which a rank
stops answering: 4 steps, a checkpoint every 2, lockstep timeout 3 s, ``--ddp_timeout`` 120 s.

``stall_worker.py OUT FAULT WHERE RANK``: rank ``RANK`` stops itself (``FAULT`` ``stop``: SIGSTOP, as
ctrl-Z or a debugger would) or dies (``kill``: SIGKILL, as the OOM killer would) at ``WHERE``: ``step``,
inside step 3's forward (the last block's; the others wait in a chunk's gather), or ``save``, inside
its optimizer save of ``checkpoint-4`` (the others wait in the save's gather, on the default group).
``checkpoint-2`` is the newest complete one then. It marks ``OUT/fault`` (the time) first; the
lowest other rank writes its pid and its default group's timeout to ``OUT/waiting.json`` when training
starts.

``stall_worker.py OUT resume FOLDER...``: the same job uninterrupted, in ``OUT/straight``, then each
``FOLDER`` resumed from its newest complete checkpoint to the end; rank 0 writes every run's losses
to ``OUT/losses.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_cases import history, make_trainer, training_args  # noqa: E402
from launch import backend_args, on_cuda  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import elixir_hf.trainer  # noqa: E402

CONFIG = '{"mode": "static", "n_blocks": "min", "offload": 0.5, "lockstep_timeout_s": 3}'
DDP_TIMEOUT = 120


def fault(out: str, how: str) -> None:
    with open(os.path.join(out, "fault"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


class Fault(TrainerCallback):
    def __init__(self, out: str, how: str, where: str, rank: int) -> None:
        self.out, self.how, self.where, self.rank = out, how, where, rank

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.process_index == min({0, 1} - {self.rank}):
            group = dist.distributed_c10d._get_default_group()
            backend = group._get_backend(torch.device("cuda" if on_cuda() else "cpu"))
            with open(os.path.join(self.out, "waiting.json"), "w") as f:
                json.dump({"pid": os.getpid(), "ddp_timeout_s": backend.options._timeout.total_seconds()}, f)
        if self.where == "step" and args.process_index == self.rank:

            def inside_step_3(*_) -> None:
                if state.global_step == 2:
                    fault(self.out, self.how)

            model.transformer.h[-1].register_forward_pre_hook(inside_step_3)


def trainer(out: str):
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="no")
    return make_trainer(
        "gpt2", training_args(out, CONFIG, **args, **backend_args(), ddp_timeout=DDP_TIMEOUT), n_train=64
    )


def main(out: str, how: str, where: str, rank: int) -> None:
    job = trainer(out)
    job.add_callback(Fault(out, how, where, rank))
    if where == "save" and job.args.process_index == rank:
        save = elixir_hf.trainer.save_optimizer

        def faulty_save(folder, *args, **kwargs):
            if os.path.basename(folder) == "checkpoint-4":
                fault(out, how)
            return save(folder, *args, **kwargs)

        elixir_hf.trainer.save_optimizer = faulty_save
    job.train()


def resume(out: str, folders: list[str]) -> None:
    straight = trainer(os.path.join(out, "straight"))
    straight.train()
    losses = {"straight": history(straight, "loss")}
    for folder in folders:
        resumed = trainer(folder)
        resumed.train(resume_from_checkpoint=True)
        losses[folder] = history(resumed, "loss", after_step=2)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()  # before the interpreter finalizes (gloo at exit)


if __name__ == "__main__":
    if on_cuda():  # a resume compared bit for bit: cuBLAS's and torch's deterministic kernels where they have one
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if sys.argv[2] == "resume":
        resume(sys.argv[1], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
