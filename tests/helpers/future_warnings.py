"""``python future_warnings.py -m MODULE ARGS`` (or ``SCRIPT ARGS``): runs it as ``python`` would, with
transformers' FutureWarnings raised as errors where the script in the current folder (a README
quickstart) or this repository's ``src/`` made the call that warns. One that a library's own code
causes (PEFT and TRL reading ``is_gradient_checkpointing``, TRL's ``SFTConfig`` default) is shown as
Python shows it: neither the README nor elixir-hf can change it.

[Note: who called] A deprecated function or argument warns from inside transformers; the frame that
called into it is the one that used the old name, past dataclass-generated ``__init__`` frames
(``<string>``) and the ``super()`` chain of the method that warns: ``TrainingArguments(
gradient_checkpointing=True)`` is the script's call, through ``ElixirTrainingArguments.__post_init__``.
A library's class in that chain (TRL's ``SFTConfig``, whose default sets the old argument) makes
it the library's.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
import warnings
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")
WARNINGS_MODULES = ("warnings.py", "_py_warnings.py")
"""The standard library's frames between a ``warnings.warn`` and ``showwarning``."""


def _under(path: str, folder: str) -> bool:
    return os.path.abspath(path).startswith(folder + os.sep)


def raise_on_ours(script_dir: str) -> None:
    transformers = os.path.dirname(importlib.util.find_spec("transformers").origin)
    show = warnings.showwarning

    def ours(frame: traceback.FrameSummary) -> bool:
        return _under(frame.filename, script_dir) or _under(frame.filename, SRC)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if Path(f.filename).name not in WARNINGS_MODULES]
        *outer, warner = frames
        if issubclass(category, FutureWarning) and _under(warner.filename, transformers):
            chain = []
            while outer and (outer[-1].filename.startswith("<") or outer[-1].name == warner.name):
                chain.append(outer.pop())
            library = any(
                not (f.filename.startswith("<") or ours(f) or _under(f.filename, transformers)) for f in chain
            )
            if outer and ours(outer[-1]) and not library:
                raise category(f"{message} (called from {outer[-1].filename}:{outer[-1].lineno})")
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.simplefilter("always", FutureWarning)


def main(argv: list[str]) -> None:
    here = os.getcwd()
    raise_on_ours(here)
    if argv[0] == "-m":
        sys.path[0], sys.argv = here, argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path[0], sys.argv = os.path.dirname(os.path.abspath(argv[0])), argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
