"""A 2-rank ElixirTrainer job (run by ``torchrun`` in ``test_rank_local_forward.py``) in which rank 0
alone, after step 2, runs a forward (``argv[2] == "forward"``) or saves the model (``"save"``), as a
main-process-only callback would, with a 2 s lockstep timeout. Each rank writes what it raised, and
when, to ``<argv[1]>/rank<r>.json``.

A rank that fails waits for the other rank's report before it exits: ``torchrun`` stops the other
ranks 0.1 s after one exits, which would race with the report."""

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
                    model(input_ids=TokenDataset(2).ids)
            else:
                self.trainer.save_model(os.path.join(self.out, "saved"))


def main(out: str, what: str) -> None:
    args = training_args(out, CONFIG, max_steps=4, eval_strategy="no", ddp_backend="gloo", ddp_timeout=120)
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
        other = os.path.join(out, f"rank{1 - rank}.json")
        deadline = time.monotonic() + 60
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.1)
        raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
