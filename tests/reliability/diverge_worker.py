"""A 2-rank ElixirTrainer job (``run_ranks`` in ``test_rank_faults.py``, on the CPU or a GPU each) in
which rank 0 alone, after step 2, runs a forward (``argv[2] == "forward"``) or saves the model
(``"save"``), as a main-process-only callback would, with a 2 s lockstep timeout. It marks
``<argv[1]>/diverged`` (the time) first; each rank that raises writes what, and when, to
``<argv[1]>/rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import torch  # noqa: E402
from hf_cases import TokenDataset, make_trainer, training_args  # noqa: E402
from launch import backend_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

CONFIG = '{"mode": "static", "n_blocks": "min", "offload": 0.5, "lockstep_timeout_s": 2}'


class MainProcessOnly(TrainerCallback):
    def __init__(self, what: str, out: str) -> None:
        self.what, self.out, self.trainer = what, out, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and state.global_step == 2:
            with open(os.path.join(self.out, "diverged"), "w") as f:
                f.write(str(time.time()))
            if self.what == "forward":
                with torch.no_grad():
                    model(input_ids=TokenDataset(2).ids.to(args.device))
            else:
                self.trainer.save_model(os.path.join(self.out, "saved"))


def main(out: str, what: str) -> None:
    args = training_args(out, CONFIG, max_steps=4, eval_strategy="no", **backend_args(), ddp_timeout=120)
    trainer = make_trainer("gpt2", args, n_train=64)
    callback = MainProcessOnly(what, out)
    callback.trainer = trainer
    trainer.add_callback(callback)
    rank = args.process_index
    try:
        trainer.train()
    except Exception as exc:
        report = {"type": type(exc).__name__, "message": str(exc), "time": time.time()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
