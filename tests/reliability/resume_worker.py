"""Run as ranks of a job (``launch.run_ranks``) by ``test_resume_change.py``: the multi-rank halves of the
resume-across-change runs, on gloo. ``argv[1]``: the output folder; ``argv[2]``: a checkpoint to
resume (``RUN`` steps, saved at ``SAVE_AT``), of a 1-rank run on 2 ranks, of a 2-rank run on 4.

* 2 ranks: ``<out>/two``: the straight 2-rank run (2 per rank × 2 micro-batches: the 1-rank run's
  global batch of 4 × 2), its checkpoints at ``SAVE_AT`` and ``RUN``; ``<out>/one_to_two``: the
  1-rank checkpoint resumed here, with another plan (another chunk size, no offload), to ``RUN``;
* 4 ranks: ``<out>/two_to_four``: the 2-rank checkpoint resumed with another plan (1 per rank).

Also imported by the test for the shared settings."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402

RUN, SAVE_AT = 8, 4
GLOBAL_BATCH = 8
OTHER_PLAN = '{"mode": "static", "n_blocks": "max", "offload": 0.0, "chunk_size": 4096}'


def trainer(out: str, plan: str, world_size: int):
    """The run every resume is compared with: ``RUN`` steps of ``GLOBAL_BATCH`` samples, saved at
    ``SAVE_AT`` and at the end, on ``world_size`` ranks (``GLOBAL_BATCH / 2 / world_size`` per rank)."""
    args = dict(
        max_steps=RUN,
        save_strategy="steps",
        save_steps=SAVE_AT,
        eval_strategy="no",
        per_device_train_batch_size=GLOBAL_BATCH // 2 // world_size,
        gradient_accumulation_steps=2,
    )
    if world_size > 1:
        args.update(ddp_backend="gloo", ddp_timeout=120)
    return make_trainer("gpt2", training_args(out, plan, **args), n_train=80)


def main(out: str, checkpoint: str) -> None:
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) == 4:
        trainer(f"{out}/two_to_four", OTHER_PLAN, 4).train(resume_from_checkpoint=checkpoint)
    else:
        trainer(f"{out}/two", OFFLOAD_PLAN, 2).train()
        trainer(f"{out}/one_to_two", OTHER_PLAN, 2).train(resume_from_checkpoint=checkpoint)

    dist.destroy_process_group()  # before the interpreter finalizes (gloo at exit)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
