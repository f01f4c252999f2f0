"""``elixir-run``: an unmodified Trainer or Accelerate script, trained by the Elixir engine.

    elixir-run train.py --model_name_or_path gpt2 --bf16 --elixir auto
    torchrun --nproc_per_node 2 -m elixir_hf.commands.run train.py ... --elixir plan.json
    accelerate launch --config_file recipes/elixir.yaml -m elixir_hf.commands.run train.py ...
    elixir-run -m trl.scripts.sft ...                       # a module instead of a file

``--elixir auto|off|JSON|FILE.json`` (anywhere on the line; bare: ``auto``) is taken out of the
script's arguments, so its own parser never sees it, and handed over as ``ELIXIR_CONFIG``
(unset: the ``elixir`` key of a TRL ``--config`` YAML file, else ``ELIXIR_CONFIG`` as it is, else ``auto``). Then every ``TrainingArguments``, ``Trainer``
and ``Accelerator`` the script builds — the stock classes and every subclass, whether defined
before or after (TRL's ``SFTConfig``/``SFTTrainer``) — is built as its Elixir version
(``patches.construct_elixir``), which reads ``ELIXIR_CONFIG``. The script then runs as
``python SCRIPT.py`` would run it: ``__main__``, ``sys.argv`` and ``sys.path[0]`` as Python sets them.
With Elixir on, its ``from_pretrained`` calls stream the weights into the chunks, a Hub id from its
snapshot in the cache, downloaded once per host (``loading.model.stream_from_pretrained_calls``;
``ELIXIR_STREAM=0`` leaves them as they are).
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Sequence

# Only the standard library at import: --help and --version answer before torch, transformers and the
# engine load (seconds); the rest is imported where it is used.

__all__ = ["main", "split_elixir", "config_file_elixir", "chosen_spec", "install"]

USAGE = "usage: elixir-run [--elixir auto|off|JSON|FILE.json] (SCRIPT.py | -m MODULE) [its arguments]"
ENV_VAR = "ELIXIR_CONFIG"  # plugin.ENV_VAR, named here so that --help loads nothing

HELP = f"""{USAGE}

Runs an unmodified Hugging Face Trainer, TRL or Accelerate script with the Elixir engine.

  elixir-run train.py --model_name_or_path gpt2 --bf16 --elixir auto
  torchrun --nproc_per_node 2 -m elixir_hf.commands.run train.py ... --elixir plan.json
  accelerate launch --config_file recipes/elixir.yaml -m elixir_hf.commands.run train.py ...
  elixir-run -m trl.scripts.sft ...                  (a module instead of a file)

--elixir auto|off|JSON|FILE.json
    anywhere on the line (bare: auto), taken out before the script's own parser sees it. auto plans
    for this model, batch and machine; off runs the stock Trainer; JSON: settings of the plan, e.g.
    '{{"offload": 0.5}}' (docs/hf.md lists them); FILE.json: settings, or a saved elixir_plan.json.
    Without it: the elixir key of a TRL --config YAML file, else ${ENV_VAR}, else auto.

Every TrainingArguments, Trainer and Accelerator the script builds (the stock classes and their
subclasses, such as TRL's SFTTrainer) runs on Elixir; otherwise the script runs as `python SCRIPT.py`
would. With Elixir on, from_pretrained loads the weights straight into Elixir's memory (a Hub model
from its cached snapshot, downloaded once per host; ELIXIR_STREAM=0 leaves from_pretrained as it is).

  -h, --help   this text (after the script: the script's own)
  --version    the version of elixir-hf"""


def split_elixir(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(spec, the other arguments)``: ``--elixir X``, ``--elixir=X`` or a bare ``--elixir``
    (``auto``). After a bare flag, the next argument is its value only if it reads as one (``auto``,
    ``off``, ``{...}``, ``*.json``, or empty, which ``ElixirPlugin.from_spec`` refuses): ``elixir-run
    --elixir train.py`` runs train.py."""
    from ..plugin import ACCEPTED, ElixirSpecError

    spec, rest = None, []
    args = iter(argv)
    for arg in args:
        if arg == "--elixir":
            value = next(args, None)
            if value is not None and not _is_spec(value):
                if _mistyped_spec(value):
                    raise ElixirSpecError(f"--elixir {value!r} is not understood: {ACCEPTED}")
                rest.append(value)
                value = None
            spec = value if value is not None else "auto"
        elif arg.startswith("--elixir="):
            spec = arg.removeprefix("--elixir=")
        else:
            rest.append(arg)
    return spec, rest


def _is_spec(arg: str) -> bool:
    from ..plugin import spec_word

    return not arg.strip() or spec_word(arg) is not None or arg.lstrip().startswith("{") or arg.endswith(".json")


_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def _mistyped_spec(arg: str) -> bool:
    """A bare word after a bare ``--elixir`` (``--elixir yes``, ``--elixir of``, ``off.``, ``0.0``): meant
    as its value, not as the script (a path, a ``.py`` file, ``-m``) or the script's own argument (a flag)."""
    return bool(_WORD.fullmatch(arg)) and not arg.endswith(".py") and not os.path.exists(arg)


def config_file_elixir(argv: Sequence[str]) -> tuple[str, str] | None:
    """``(source, spec)`` of the ``elixir`` key of the YAML file after ``--config`` (TRL's ``TrlParser``
    convention: ``trl.scripts.sft --config sft.yaml``), if it has one (``config_file.elixir_key``). It comes
    after ``--elixir`` on the command line and before ``ELIXIR_CONFIG``, as TRL ranks the command line
    above the file."""
    from ..config_file import elixir_key

    args = list(argv)
    if "--config" not in args[:-1]:
        return None
    return elixir_key(args[args.index("--config") + 1])


def chosen_spec(flag: str | None, in_config: tuple[str, str] | None) -> tuple[str, str]:
    """``(source, spec)``: elixir-run's ``--elixir``, else the config file's key, else ``ELIXIR_CONFIG``, else auto."""
    if flag is not None:
        return "--elixir", flag
    if in_config is not None:
        return in_config
    return ENV_VAR, os.environ.get(ENV_VAR, "auto")


def install() -> None:
    """Every ``TrainingArguments``, ``Trainer`` and ``Accelerator`` built from now on is an Elixir one,
    and ``get_last_checkpoint`` skips torn Elixir checkpoints (``checkpoint/restart.py``)."""
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments

    from .. import patches
    from ..accelerator import elixir_accelerator
    from ..arguments import elixir_args
    from ..checkpoint.restart import get_last_checkpoint
    from ..trainer import elixir_trainer

    patches.construct_elixir(TrainingArguments, elixir_args)
    patches.construct_elixir(Trainer, elixir_trainer)
    patches.construct_elixir(Accelerator, elixir_accelerator)
    patches.replace_get_last_checkpoint(get_last_checkpoint)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):  # elixir-run's own, before a script: the script's come after it
        print(HELP)
        sys.exit(0)
    if argv[:1] == ["--version"]:
        from .. import __version__

        print(f"elixir-run (elixir-hf) {__version__}")
        sys.exit(0)
    from .. import patches
    from ..console import connect_logging
    from ..loading.model import STREAM_ENV, stream_from_pretrained_calls
    from ..plugin import ElixirPlugin, ElixirSpecError

    try:
        spec, rest = split_elixir(argv)
    except ElixirSpecError as exc:
        sys.exit(f"elixir-run: {exc}")
    module = rest[:1] == ["-m"]
    target = rest[1:2] if module else rest[:1]
    if not target or target[0].startswith("-"):
        sys.exit(f"elixir-run: name the script to run\n{USAGE}")
    in_config = config_file_elixir(rest)
    source, spec = chosen_spec(spec, in_config)
    try:
        plugin = ElixirPlugin.from_spec(spec, source)  # a bad value fails here, before the script loads its model
    except ElixirSpecError as exc:
        sys.exit(f"elixir-run: {exc}")
    os.environ[ENV_VAR] = spec
    connect_logging()
    install()
    if in_config is not None:
        patches.config_key_taken("elixir")  # read here: TrlParser must not refuse it nor let it beat --elixir
    if plugin is not None and os.environ.get(STREAM_ENV, "1") != "0":
        stream_from_pretrained_calls()
    if module:
        sys.argv = [target[0], *rest[2:]]  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()  # as python -m does
        runpy.run_module(target[0], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(target[0])
        sys.argv = [target[0], *rest[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
