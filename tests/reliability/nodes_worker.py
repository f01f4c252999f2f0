"""One rank of a 2-rank ElixirTrainer job (6 steps, a checkpoint every 2), run by
``test_multinode.py`` as 1 node x 2 ranks (under ``torchrun``) or 2 nodes x 1 rank on one machine:
``argv[1]`` ``node-local`` (``save_on_each_node``) or ``shared``; ``argv[2]`` ``final``: then the model is
saved to ``final/`` and ``main`` returns, as ``run_clm.py`` ends (``test_multinode.py``'s clean exit),
``-``: not; then per node (``GROUP_RANK``) its output folder and a checkpoint to resume from (``-``:
none, ``last``: ``resume_from_checkpoint=True``)."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, make_trainer, training_args  # noqa: E402


def main(disks: str, final: str, *nodes: str) -> None:
    node = int(os.environ["GROUP_RANK"])
    out, resume = nodes[2 * node : 2 * node + 2]
    args = training_args(
        out,
        OFFLOAD_PLAN,
        max_steps=6,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=2,
        save_on_each_node=disks == "node-local",
        ddp_backend="gloo",
        ddp_timeout=120,
    )
    trainer = make_trainer("gpt2", args, n_train=64)
    trainer.train(resume_from_checkpoint={"-": None, "last": True}.get(resume, resume))
    if final == "final":
        trainer.save_model(f"{out}/final")


if __name__ == "__main__":
    main(*sys.argv[1:])
