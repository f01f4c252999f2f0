"""A Hugging Face Trainer script with no Elixir in it, in run_clm's shape: ``HfArgumentParser``
over its own dataclass and ``TrainingArguments``, ``Trainer``, then ``save_model`` and
``save_state``. ``test_run.py`` runs it as is (also under torchrun) and through ``elixir-run``."""

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, default_data_collator


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
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
