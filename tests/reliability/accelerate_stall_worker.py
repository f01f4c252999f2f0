"""An ``ElixirAccelerator`` loop on 2 gloo ranks (``run_ranks`` in ``test_rank_faults.py``), lockstep
timeout 2 s, that gathers each step's loss (``accelerator.gather``) after the engine's step; rank 1
stops itself (SIGSTOP) between steps 2 and 3, after its ``zero_grad``, marking ``OUT/fault`` (the time)
first, while rank 0 goes on into the gather. ``accelerate_stall_worker.py OUT``."""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import torch  # noqa: E402
from hf_cases import VOCAB, TokenDataset  # noqa: E402

import elixir_hf  # noqa: E402
from helpers.models import MODEL_BUILDERS  # noqa: E402

CONFIG = '{"mode": "static", "n_blocks": "min", "offload": 0.5, "lockstep_timeout_s": 2}'


def main(out: str) -> None:
    accelerator = elixir_hf.ElixirAccelerator(elixir_plugin=CONFIG, cpu=True)
    model = MODEL_BUILDERS["gpt2"](seed=0, vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenDataset(16), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader, 1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 2 and accelerator.process_index == 1:
            with open(os.path.join(out, "fault"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        accelerator.gather(loss.detach())


if __name__ == "__main__":
    main(sys.argv[1])
