"""Text, tokenizer and blocks for the GPT-2 recipe, offline by default.

* The default corpus is built on any machine from the docstrings of Python's standard library
  (deterministic for a given Python version; ~0.5 MB of English technical prose), so the recipe
  needs no download. ``--train_file`` (.txt natively; .json/.jsonl/.csv through ``datasets``) or
  ``--dataset_name`` (``datasets``, online or from its cache) replace it.
* The tokenizer is a byte-level BPE trained on the training text with ``tokenizers`` and cached
  under ``$ELIXIR_CACHE_DIR`` (default ``~/.cache/elixir``), unless ``--tokenizer_name`` or
  ``--model_name_or_path`` provides one.
* Texts are tokenized, joined with the end-of-text token and cut into ``block_size`` blocks
  (run_clm's ``group_texts``); labels are the inputs, HF shifts them.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["cache_dir", "stdlib_corpus", "load_texts", "train_tokenizer", "BlockDataset", "split_texts"]

EOS = "<|endoftext|>"

# Modules whose docstrings make up the default corpus (all pure-Python stdlib, importable everywhere).
_CORPUS_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib email enum fractions functools gzip hashlib heapq html http.client imaplib inspect io "
    "ipaddress itertools json logging mailbox math mimetypes multiprocessing numbers operator os pathlib "
    "pickle pprint queue random re sched secrets selectors shlex shutil smtplib socket statistics string "
    "struct subprocess tarfile tempfile textwrap threading timeit tokenize traceback types typing unittest "
    "urllib.parse urllib.request uuid warnings weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo"
).split()


def cache_dir() -> Path:
    path = Path(os.environ.get("ELIXIR_CACHE_DIR", Path.home() / ".cache" / "elixir"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def stdlib_corpus() -> list[str]:
    """One document per module, class, function and method docstring, in a fixed order."""
    docs: dict[str, None] = {}  # ordered and de-duplicated
    for name in _CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in _documented(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                docs[doc] = None
    if not docs:
        raise RuntimeError(
            "the standard library has no docstrings here (python -OO?): run without -OO or pass --train_file"
        )
    return list(docs)


def _documented(module) -> list:
    objs = [module]
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            objs.append(value)
        elif inspect.isclass(value):
            objs.append(value)
            objs += [v for k, v in sorted(vars(value).items()) if not k.startswith("_") and inspect.isfunction(v)]
    return objs


def load_texts(
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None,
    validation_split_percentage: int,
) -> tuple[list[str], list[str]]:
    """(train texts, validation texts) from the chosen source; a held-out split when none is given."""
    if dataset_name is not None:
        train, valid = _from_datasets(dataset_name, dataset_config_name, None, None)
    elif train_file is not None:
        if train_file.endswith(".txt") and (validation_file is None or validation_file.endswith(".txt")):
            train = _read_txt(train_file)
            valid = _read_txt(validation_file) if validation_file else []
        else:
            train, valid = _from_datasets(None, None, train_file, validation_file)
    else:
        train, valid = stdlib_corpus(), []
    if not valid:
        train, valid = split_texts(train, validation_split_percentage)
    return train, valid


def split_texts(texts: Sequence[str], percent: int) -> tuple[list[str], list[str]]:
    """Every ``100 // percent``-th text goes to validation (deterministic, spread over the corpus)."""
    every = max(2, 100 // max(percent, 1))
    return [t for i, t in enumerate(texts) if i % every], [t for i, t in enumerate(texts) if not i % every]


def _read_txt(path: str) -> list[str]:
    """Paragraphs (blank-line separated) of a text file."""
    text = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _from_datasets(name, config, train_file, validation_file) -> tuple[list[str], list[str]]:
    try:
        import datasets
    except ImportError as exc:
        raise SystemExit(
            "--dataset_name and non-.txt --train_file need the `datasets` package: pip install datasets"
        ) from exc
    if name is not None:
        raw = datasets.load_dataset(name, config)
    else:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        ext = Path(train_file).suffix.lstrip(".")
        raw = datasets.load_dataset({"jsonl": "json"}.get(ext, ext), data_files=files)
    column = "text" if "text" in raw["train"].column_names else raw["train"].column_names[0]
    valid = list(raw["validation"][column]) if "validation" in raw else []
    return [t for t in raw["train"][column] if t], [t for t in valid if t]


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerBase:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``; cached by content and size."""
    digest = hashlib.sha256(f"bpe-v2\0{vocab_size}\0".encode() + "\0".join(texts).encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{digest}"
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        # no pad token: blocks are never padded (and a pad equal to EOS makes HF warn about masks)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        fast.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process cached the same tokenizer first
            shutil.rmtree(tmp, ignore_errors=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = max_length
    return tokenizer


class BlockDataset(torch.utils.data.Dataset):
    """run_clm's ``group_texts``: all texts joined by EOS, cut into equal blocks, remainder dropped."""

    def __init__(self, texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, block_size: int) -> None:
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for encoded in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]:
            ids += encoded + [eos]
        n = len(ids) // block_size
        if n == 0:
            raise ValueError(f"only {len(ids)} tokens: fewer than one block of {block_size}; lower --block_size")
        self.blocks = torch.tensor(ids[: n * block_size]).view(n, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}
