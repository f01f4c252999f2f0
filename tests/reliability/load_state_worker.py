"""Run as ranks of a job (``launch.run_ranks``) by ``test_checkpoint_faults.py``: an ElixirAccelerator loop on 2 gloo
ranks saves its state, rank 0 deletes rank 1's optimizer file, and both ranks load the state.
Each rank writes what ``load_state`` raised to ``<out>/rank{r}.txt``."""

from __future__ import annotations

import os
import sys

import torch

sys.path[:0] = [
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elixir_hf"),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

from hf_cases import OFFLOAD_PLAN, VOCAB, TokenDataset  # noqa: E402

import elixir_hf  # noqa: E402
from helpers.models import MODEL_BUILDERS  # noqa: E402


def main(out: str) -> None:
    accelerator = elixir_hf.ElixirAccelerator(elixir_plugin=OFFLOAD_PLAN, cpu=True)
    model = MODEL_BUILDERS["gpt2"](seed=0, vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenDataset(8), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(f"{out}/state")
    if accelerator.is_main_process:
        os.remove(f"{out}/state/optimizer-00001-of-00002.safetensors")
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(f"{out}/state")
        outcome = "loaded"
    except Exception as e:  # noqa: BLE001 - the test reads it
        outcome = f"{type(e).__name__}: {e}"
    with open(f"{out}/rank{accelerator.process_index}.txt", "w") as f:
        f.write(outcome)


if __name__ == "__main__":
    main(sys.argv[1])
