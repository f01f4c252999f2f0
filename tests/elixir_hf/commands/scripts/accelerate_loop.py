"""An Accelerate training loop with no Elixir in it, in run_clm_no_trainer's shape: ``Accelerator``,
``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, a scheduler, ``save_state`` at the
end. ``test_run.py`` runs it as is (also under torchrun) and through ``elixir-run``."""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, get_scheduler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=args.cpu)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, attn_implementation="eager")
    ids = torch.randint(0, model.config.vocab_size, (48, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    accelerator.save_state(os.path.join(args.output_dir, "state"))
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
