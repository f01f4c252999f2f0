"""A Hugging Face Trainer script with no Elixir in it, in run_clm's shape: ``HfArgumentParser``
over its own dataclass and ``TrainingArguments``, ``Trainer``, then ``save_model`` and
``save_state``; it resumes from ``get_last_checkpoint(output_dir)`` when the folder holds checkpoints,
as run_clm did up to transformers 4.x and restart-loop scripts do. ``test_run.py`` runs it as is (also
under torchrun) and through ``elixir-run``; ``tests/reliability/test_restart.py`` restarts it."""

import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, default_data_collator
from transformers.trainer_utils import get_last_checkpoint


@dataclass
class ScriptArguments:
    model_name_or_path: str
    n_train: int = 48
    seq_len: int = 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path, attn_implementation="eager")
    vocab = model.config.vocab_size
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(script_args.n_train, script_args.seq_len, vocab, seed=0),
        eval_dataset=RandomTokens(8, script_args.seq_len, vocab, seed=1),
        data_collator=default_data_collator,
    )
    last_checkpoint = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint or last_checkpoint)
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
