"""Conversations for the SFT recipe: a ``datasets`` source, the tokenizer's chat template, loss on
the answers only.

* A source is a Hub dataset id (``yahma/alpaca-cleaned`` by default, read from the ``datasets``
  cache when offline) or a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file or data folder.
* Each row becomes a list of messages, from the first of these columns it has: ``messages``
  (TRL's conversational format: ``[{"role": ..., "content": ...}, ...]``), ``prompt`` +
  ``completion`` (TRL's prompt-completion format), ``instruction`` + ``output`` with an optional
  ``input`` (Alpaca's).
* The conversation is rendered by the tokenizer's chat template and tokenized once; a token is
  learned from (its label kept) where it starts inside an assistant turn, every other label is
  -100 (the prompt, the system text, the template's headers). Rows cut to ``max_length`` that keep
  no answer token are dropped (counted in the log).

[Note: answer spans]
An assistant turn ``i`` spans the characters between the rendering of the messages before it with
the generation prompt (``add_generation_prompt=True``) and the rendering of the messages up to it.
That needs each rendering to be a prefix of the next, which the templates of Llama-3.1, Qwen2.5 and
Mistral-v0.3 are for alternating user/assistant turns; a template that is not (Mistral's moves a
system message into the last user turn) is refused with the row, not trained with wrong labels.
Spans are matched to tokens by their character offsets, so no token is split at a turn's edge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE", "load_source", "message_builder", "answer_spans", "tokenize_conversation", "sft_dataset"]

logger = logging.getLogger("sft-recipe")

IGNORE = -100
"""The label of a token the loss skips (transformers' ``ignore_index``)."""
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

Messages = list[dict[str, str]]


def load_source(name: str, config_name: str | None, split: str, cache_dir: str | None) -> datasets.Dataset:
    """The split ``split`` of a Hub dataset or local folder ``name``, or a local data file."""
    path = Path(name)
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise SystemExit(f"--dataset {name}: a {path.suffix!r} file; pass one of {sorted(FILE_BUILDERS)}")
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    try:
        return datasets.load_dataset(name, config_name, split=split, cache_dir=cache_dir)
    except Exception as exc:  # offline and not cached, a typo, a gated dataset: the same fix
        raise SystemExit(
            f"--dataset {name}: cannot load split {split!r} ({type(exc).__name__}: {exc}); offline, pass a local "
            "file (--dataset path/to/data.jsonl with a messages, prompt+completion or instruction+output column)"
        ) from exc


def message_builder(columns: list[str]) -> Callable[[dict[str, Any]], Messages]:
    """How a row of these columns becomes messages (the formats of the module's docstring)."""
    if "messages" in columns:
        return lambda row: row["messages"]
    if {"prompt", "completion"} <= set(columns):
        return lambda row: [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
    if {"instruction", "output"} <= set(columns):
        has_input = "input" in columns

        def alpaca(row: dict[str, Any]) -> Messages:
            extra = row["input"] if has_input else None
            prompt = f"{row['instruction']}\n\n{extra}" if extra else row["instruction"]
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]

        return alpaca
    raise SystemExit(
        f"the dataset's columns {columns} hold no conversation: it needs 'messages', 'prompt' + 'completion', or "
        "'instruction' + 'output' (+ 'input')"
    )


def answer_spans(messages: Messages, tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns ([Note: answer spans])."""

    def render(part: Messages, prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    text, spans = render(messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], prompt=True), render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"the chat template does not render assistant turn {i} after the turns before it, so its answer "
                f"cannot be told from the prompt (a system message moved into a later turn?): {messages!r}"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(
    messages: Messages, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> dict[str, list[int]]:
    """``input_ids``, ``attention_mask`` and ``labels`` (answer tokens only) of one conversation."""
    text, spans = answer_spans(messages, tokenizer)
    # the template writes the BOS token itself
    enc = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_length, return_offsets_mapping=True)
    labels = [
        token if any(start <= begin < end for start, end in spans) else IGNORE
        for token, (begin, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def sft_dataset(
    raw: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, num_proc: int | None = None
) -> datasets.Dataset:
    """Every row tokenized (cached by ``datasets``), rows without an answer token left out."""
    if tokenizer.chat_template is None:
        raise SystemExit(
            f"the tokenizer of {tokenizer.name_or_path} has no chat template: pass --tokenizer_name with an instruct "
            "model's tokenizer (e.g. meta-llama/Llama-3.1-8B-Instruct for Llama-3.1-8B)"
        )
    if not tokenizer.is_fast:
        raise SystemExit(f"the tokenizer of {tokenizer.name_or_path} is not a fast one: the answer labels need offsets")
    as_messages = message_builder(raw.column_names)

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        encoded = [tokenize_conversation(as_messages(row), tokenizer, max_length) for row in rows]
        kept = [e for e in encoded if any(label != IGNORE for label in e["labels"])]
        return {key: [e[key] for e in kept] for key in ("input_ids", "attention_mask", "labels")}

    tokenized = raw.map(
        tokenize, batched=True, remove_columns=raw.column_names, num_proc=num_proc, desc="Applying the chat template"
    )
    if len(tokenized) < len(raw):
        logger.warning(
            "%d of %d conversations left out: no answer token within --max_seq_length %d",
            len(raw) - len(tokenized),
            len(raw),
            max_length,
        )
    if not len(tokenized):
        raise SystemExit(f"no conversation keeps an answer token within --max_seq_length {max_length}: raise it")
    return tokenized
