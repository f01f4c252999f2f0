"""Run under ``torchrun --nproc_per_node 2`` (CPU, gloo) by ``test_distributed.py``.

On every rank: a stock DDP Trainer run, the same run through ElixirTrainer (saving a checkpoint
half-way and the final model), and a resume from that checkpoint. Rank 0 writes what the test
compares to ``<out>/result.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from hf_cases import OFFLOAD_PLAN, history, make_trainer, training_args  # noqa: E402

STEPS = 8
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's timeout asks for every stack


def main(out: str) -> None:
    common = dict(max_steps=STEPS, eval_steps=4, ddp_backend="gloo", ddp_timeout=120)
    ddp = make_trainer("gpt2", training_args(f"{out}/ddp", **common))
    ddp.train()
    ddp.save_model(f"{out}/ddp_final")

    elixir_args = dict(save_strategy="steps", save_steps=STEPS // 2, **common)
    full = make_trainer("gpt2", training_args(f"{out}/elixir", OFFLOAD_PLAN, **elixir_args))
    full.train()
    full.save_model(f"{out}/elixir_final")

    resumed = make_trainer("gpt2", training_args(f"{out}/elixir", OFFLOAD_PLAN, **elixir_args))
    resumed.train(resume_from_checkpoint=f"{out}/elixir/checkpoint-{STEPS // 2}")

    if dist.get_rank() == 0:
        result = {
            "world_size": dist.get_world_size(),
            "ddp": {k: history(ddp, k) for k in ("loss", "grad_norm", "eval_loss")},
            "elixir": {k: history(full, k) for k in ("loss", "grad_norm", "eval_loss")},
            "resumed": {k: history(resumed, k) for k in ("loss", "grad_norm", "eval_loss")},
        }
        with open(f"{out}/result.json", "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()  # without it a gloo run with several Trainers can abort at exit


if __name__ == "__main__":
    main(sys.argv[1])
