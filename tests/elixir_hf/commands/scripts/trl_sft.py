"""A TRL SFT script with no Elixir in it, in trl/scripts/sft.py's shape: ``HfArgumentParser``
over its own dataclass and ``SFTConfig``, ``SFTTrainer`` (with a PEFT LoRA adapter under
``--use_peft``), ``save_model`` and ``save_state``. ``test_run.py`` runs it as is and through
``elixir-run``."""

import random
from dataclasses import dataclass

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str
    use_peft: bool = False
    n_train: int = 32


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())
    rng = random.Random(0)
    dataset = Dataset.from_dict({"text": [" ".join(rng.choices(words, k=12)) for _ in range(script_args.n_train)]})
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0)
        if script_args.use_peft
        else None
    )
    trainer = SFTTrainer(
        model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
