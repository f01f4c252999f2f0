"""Text, tokenizer and blocks for the GPT-2 recipe, with ``datasets`` as run_clm.py does, offline by default.

* The default corpus is the source code of Python's standard library (its ``.py`` files of 1 kB or more outside
  the test suites: ~12.6 MB, ~3.3M tokens of the recipe's 8192-token BPE on Python 3.11), so the
  recipe needs no download and the GPU default (200 steps of 8 x 1024 tokens, 1.6M tokens) sees
  about half an epoch. It is deterministic for a given Python version: the files in a fixed
  pseudo-random order (sha256 of their paths), one document each, written once as JSON lines
  under ``$ELIXIR_CACHE_DIR`` (default ``~/.cache/elixir``). ``--corpus_mb`` takes its first
  megabytes (the CPU default takes 2). ``--train_file`` (.txt/.json/.jsonl/.csv) or
  ``--dataset_name`` (online, or from the ``datasets`` cache) replace it.
* Every source goes through ``datasets.load_dataset`` (``--streaming`` for an iterable one); a
  source without a validation split has every ``100 // --validation_split_percentage``-th
  document held out (deterministic, spread over the corpus).
* The tokenizer is a byte-level BPE trained on the training text with ``tokenizers`` and cached,
  unless ``--tokenizer_name`` or ``--model_name_or_path`` provides one.
* Tokenizing and grouping are run_clm's two ``map`` calls, cached by ``datasets`` (a second run
  with the same data and tokenizer reads the cache; ``--overwrite_cache`` redoes them) and spread
  over ``--preprocessing_num_workers`` processes: each document's tokens end with the
  end-of-text token, the documents are joined and cut into ``block_size`` blocks (``group_texts``;
  the remainder of each 1000-document batch is dropped); labels are the inputs, HF shifts them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["cache_dir", "stdlib_corpus", "load_raw", "train_tokenizer", "lm_datasets"]

EOS = "<|endoftext|>"
MIN_DOCUMENT_BYTES = 1000
"""Smaller standard-library files (empty ``__init__.py`` files, which some Python builds ship many
of) are left out of the default corpus: a small held-out split of them could hold no whole block."""
STREAMED_TOKENIZER_TEXTS = 10_000
"""With ``--streaming`` and no tokenizer, the BPE is trained on the stream's first documents."""


def cache_dir() -> Path:
    path = Path(os.environ.get("ELIXIR_CACHE_DIR", Path.home() / ".cache" / "elixir"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def stdlib_corpus(max_mb: float | None = None) -> Path:
    """The default corpus as a JSON-lines file (``{"text": <a source file>}`` per line), built once."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not {"test", "tests", "site-packages", "__pycache__"} & set(p.relative_to(root).parts[:-1])
        and p.stat().st_size >= MIN_DOCUMENT_BYTES
    ]
    files.sort(key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest())
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    size_tag = "all" if max_mb is None else f"{max_mb:g}mb"
    path = cache_dir() / "corpus" / f"stdlib-{version}-{len(files)}files-{size_tag}.jsonl"
    if path.is_file():
        return path
    lines, size = [], 0
    for p in files:
        if max_mb is not None and size >= max_mb * 1e6:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines.append(json.dumps({"text": text}))
        size += len(text)
    if not lines:
        raise SystemExit(f"no Python source under {root} to build the default corpus from: pass --train_file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def load_raw(data_args: Any, cache: str | None) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """run_clm's sources: ``train`` and ``validation`` splits with the text in their first column
    (or ``text``)."""
    streaming = data_args.streaming
    if data_args.dataset_name is not None:
        raw = datasets.load_dataset(
            data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache, streaming=streaming
        )
    else:
        files = {"train": data_args.train_file or str(stdlib_corpus(data_args.corpus_mb))}
        if data_args.validation_file is not None:
            files["validation"] = data_args.validation_file
        extension = Path(files["train"]).suffix.lstrip(".")
        kwargs = {"keep_linebreaks": data_args.keep_linebreaks} if extension == "txt" else {}
        builder = {"txt": "text", "jsonl": "json"}.get(extension, extension)
        raw = datasets.load_dataset(builder, data_files=files, cache_dir=cache, streaming=streaming, **kwargs)
    if "validation" not in raw:
        every = max(2, 100 // max(data_args.validation_split_percentage, 1))
        full = raw["train"]
        raw["validation"] = full.filter(lambda _, i: i % every == 0, with_indices=True)
        raw["train"] = full.filter(lambda _, i: i % every != 0, with_indices=True)
    return raw


def columns(split: datasets.Dataset | datasets.IterableDataset) -> list[str]:
    """Its column names (a streamed split may only know them from its first row)."""
    return list(split.column_names or next(iter(split)).keys())


def text_column(raw: datasets.DatasetDict | datasets.IterableDatasetDict) -> str:
    names = columns(raw["train"])
    return "text" if "text" in names else names[0]


def training_texts(raw: datasets.DatasetDict | datasets.IterableDatasetDict, streaming: bool) -> Iterable[str]:
    column = text_column(raw)
    if streaming:
        return [row[column] for row in itertools.islice(raw["train"], STREAMED_TOKENIZER_TEXTS)]
    return raw["train"][column]


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerBase:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``; cached by content and size."""
    texts = [t for t in texts if t]
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


def lm_datasets(
    raw: datasets.DatasetDict | datasets.IterableDatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """run_clm's ``tokenize_function`` and ``group_texts`` maps (cached unless streaming)."""
    column, eos = text_column(raw), tokenizer.eos_token_id
    tail = [] if eos is None else [eos]

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch[column], verbose=False)["input_ids"]
        return {"input_ids": [x + tail for x in ids]}

    def group_texts(batch: dict[str, list]) -> dict[str, list]:
        ids = list(itertools.chain(*batch["input_ids"]))
        blocks = [ids[i : i + block_size] for i in range(0, len(ids) // block_size * block_size, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    def options(desc: str) -> dict[str, Any]:  # a stream is mapped lazily, as it is read: nothing to cache
        return {} if streaming else dict(num_proc=num_proc, load_from_cache_file=not overwrite_cache, desc=desc)

    streaming = isinstance(raw, datasets.IterableDatasetDict)
    tokenized = raw.map(
        tokenize, batched=True, remove_columns=columns(raw["train"]), **options("Running tokenizer on dataset")
    )
    blocks = tokenized.map(group_texts, batched=True, **options(f"Grouping texts in chunks of {block_size}"))
    for name, split in ({} if streaming else blocks).items():
        if len(split) == 0:
            raise SystemExit(
                f"the {name} split holds fewer than {block_size} tokens, not one block of --block_size {block_size}: "
                "give it more text (--corpus_mb, --validation_split_percentage) or lower --block_size"
            )
    return blocks
