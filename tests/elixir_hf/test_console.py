"""Elixir's loggers under transformers' (level, handler), its bars through transformers' tqdm switch
(lines in a log), the Accelerate rule for replicas. The Trainer's flags on two ranks: test_distributed.py."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from transformers.utils import logging as hf_logging

from elixir_hf import console
from elixir_runtime.progress import progress, set_progress_factory


@pytest.fixture
def verbosity():
    before = hf_logging.get_verbosity()
    yield
    hf_logging.set_verbosity(before)


def test_the_engines_loggers_take_transformers_level_and_handler(verbosity) -> None:
    console.connect_logging()  # what the entry points call (follow_trainer, build_engine, ...)
    engine = logging.getLogger("elixir_runtime.planner")
    hf_logging.set_verbosity_info()
    assert engine.isEnabledFor(logging.INFO)
    hf_logging.set_verbosity_warning()
    assert not engine.isEnabledFor(logging.INFO) and engine.isEnabledFor(logging.WARNING)

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    tree = logging.getLogger("elixir_runtime")
    try:
        tree.setLevel(logging.DEBUG)  # a level set on the tree wins over transformers'
        engine.debug("elixir: shown")
    finally:
        tree.setLevel(logging.NOTSET)
        hf_logging.get_logger("transformers").removeHandler(handler)
    engine.info("elixir: hidden")
    assert seen == ["elixir: shown"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_are_transformers_tqdm_and_follow_its_switch(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", Terminal())
    previous = console.show_progress(True)
    try:
        hf_logging.disable_progress_bar()
        with progress(3, "elixir: off") as bar:
            assert isinstance(bar, hf_logging.EmptyTqdm)
        hf_logging.enable_progress_bar()
        with progress(3, "elixir: on") as bar:
            bar.update(3)
    finally:
        hf_logging.enable_progress_bar()
        set_progress_factory(previous)
    err = sys.stderr.getvalue()
    assert "\relixir: on" in err and "elixir: off" not in err


def test_in_a_log_a_phase_is_a_line_as_it_starts_and_one_as_it_ends(monkeypatch) -> None:
    """stderr not a terminal (a file, a scheduler's log): no redraws; nothing while bars are off."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    previous = console.show_progress(True)
    try:
        with progress(3, "elixir: filling host chunk shards", unit="chunk") as bar:
            bar.update(3)
        with progress(None, "elixir: writing model.safetensors", unit="B") as bar:
            bar.update(2_500_000)
        with pytest.raises(RuntimeError), progress(4, "elixir: profiling a training step") as bar:
            bar.update()
            raise RuntimeError("out of memory")
        monkeypatch.setenv("TQDM_DISABLE", "1")
        with progress(3, "elixir: off by TQDM_DISABLE") as bar:
            bar.update(3)
        monkeypatch.delenv("TQDM_DISABLE")
        hf_logging.disable_progress_bar()
        with progress(3, "elixir: off by transformers") as bar:
            bar.update(3)
    finally:
        hf_logging.enable_progress_bar()
        set_progress_factory(previous)
    lines = sys.stderr.getvalue().splitlines()
    want = [
        r"elixir: filling host chunk shards \(3 chunks\) \.\.\.",
        r"elixir: filling host chunk shards: done in \d+\.\d s",
        r"elixir: writing model.safetensors \.\.\.",
        r"elixir: writing model.safetensors: done in \d+\.\d s",
        r"elixir: profiling a training step \.\.\.",
        r"elixir: profiling a training step: stopped after \d+\.\d s, at 1 of 4 it",
    ]
    assert len(lines) == len(want) and all(re.fullmatch(w, line) for w, line in zip(want, lines)), lines


def test_accelerate_replicas_log_warnings_until_a_trainer_sets_levels() -> None:
    previous = set_progress_factory(None)
    trees = [logging.getLogger(name) for name in console.LOGGER_TREES]
    try:
        console.follow_accelerator(is_main_process=False)
        assert [t.level for t in trees] == [logging.WARNING] * 2
        console.follow_trainer(type("Args", (), {"process_index": 1, "disable_tqdm": False})())
        assert [t.level for t in trees] == [logging.NOTSET] * 2
    finally:
        for t in trees:
            t.setLevel(logging.NOTSET)
        set_progress_factory(previous)
