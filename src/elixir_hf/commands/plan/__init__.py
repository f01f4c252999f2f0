"""``elixir-plan``: the plan ``--elixir auto`` would make, without a GPU and without allocating.

    elixir-plan --model gpt2-10b --seq-len 1024 --batch-size 8 --gpus 2 --gpu-mem 80GiB --host-mem 256GiB
    elixir-plan --model gpt2-10b --seq-len 1024 --batch-size 8 --hardware h100 --gpu-memory 40GiB  # a cap per GPU
    elixir-plan --model llama3-8b --seq-len 2048 --batch-size 4 --gpu a100-80gb   # a card you do not own
    elixir-plan --model path/to/config.json --hardware hw.json --json
    elixir-plan --model llama3-8b --elixir '{"offload": 0.5, "n_blocks": "min"}'   # what the run's --elixir says
    elixir-plan --measure-hardware hw.json        # on the GPU machine: its profile, for planning elsewhere
    elixir-plan --run out/                        # a Trainer run's measured numbers against its plan, per rank

The model is built from its config on the meta device, one training step is profiled on fake
tensors, and the planner picks chunk size, rCache size and offloaded chunks for the given GPUs and
memory, through the same decision as ``--elixir auto`` (``elixir_runtime.planner.plan_model``). The
GPU's rates come from ``--gpu``/``--hardware`` (a shipped card, or a profile file), else from this
machine's GPU; without a GPU, from the shipped ``h100`` profile (said in the output): a GPU plan is
never timed with a CPU's rates. Host memory goes with the GPU's profile unless ``--host-mem`` says
otherwise (``hardware.py``). What the run asks of the engine is its ``--elixir`` JSON (the
same keys, the same parser: ``ElixirPlugin``), of which ``--dtype``, ``--gpu-memory``,
``--device-lane`` and ``--stock-loss`` are shorthands. This module parses the command line and calls
in: ``report.py`` makes the report, ``plot.py`` draws it, ``run.py`` shows a run against its plan
(``--run``; the table and plot are ``run_report.py``'s). ``python -m elixir_hf.commands.plan`` runs it
(``__main__.py``).

Exit status: 0 a plan (or --run's table, --measure-hardware's profile); 1 bad input (a flag's value, an
unknown model, card or file, --gpu-memory above the card, a run folder without records); 2 no plan fits
(PlanError: the message says what would make it fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ... import __version__
from .lora import LORA_RANK, LORA_TARGETS, PEFT_EXTRA, lora_of, lora_targets
from .names import CARDS, MOMENTS, REFERENCE
from .sizes import parse_size

if TYPE_CHECKING:
    from elixir_runtime.config import ElixirConfig

    from .report import Profiles

# [Note: --help and --version before torch]
# Only the standard library and the package's own stdlib-only modules at import (names.py, lora.py):
# --help and --version answer in a fraction of a second (torch alone takes seconds to import); the
# engine, transformers and the planner load where they are used, after the command line parsed.

__all__ = ["main", "parse_size", "DEVICE_LANE_WORDS", "EXIT_INPUT", "EXIT_NO_FIT"]

EXIT_INPUT = 1
"""Bad input: a flag's value, an unknown model, card or file; the message names it and the fix."""
EXIT_NO_FIT = 2
"""No plan fits the GPUs and host memory given; the message says what would."""

DESCRIPTION = """\
The plan --elixir auto would make for a model, without a GPU and without allocating: GPU memory per
GPU (model states, gathered-parameter cache, activations), host memory, which chunks are offloaded
to host memory and why, and the predicted step time.

examples:
  elixir-plan --model gpt2-10b --seq-len 1024 --batch-size 8 --gpus 2 --gpu-mem 80GiB --host-mem 256GiB
  elixir-plan --model path/to/config.json --hardware h100 --gpu-memory 40GiB --plot plan.png
  elixir-plan --model llama3-8b --seq-len 2048 --gpus 2 --gpu a100-80gb   (a card you do not own)
  elixir-plan --model llama3.1-70b --seq-len 4096 --gpus 8 --gpu h100 --host-mem 2TiB --host-cores 112   (a DGX node)
  elixir-plan --model llama3-8b --elixir '{"offload": 0.5, "cpu_threads": 6}'   (the run's --elixir keys)
  elixir-plan --model qwen2.5-14b --gpu h100 --lora --lora-rank 16   (a LoRA fine-tune: PEFT's adapters)
  elixir-plan --measure-hardware hw.json   (on the GPU machine; then --hardware hw.json elsewhere)
  elixir-plan --run out/   (an Elixir Trainer run's --output_dir: predicted vs measured, per rank)

Sizes: 80GiB, 80G (binary), 80GB (decimal), 512MiB; a bare number is GiB.

exit status: 0 a plan; 1 bad input (the message names the flag and the fix); 2 no plan fits (the
message says what would make it fit)."""

DEVICE_LANE_WORDS = {"off": False, "on": True, "auto": "auto"}
"""``ElixirConfig.device_assisted_update`` by the word a command line takes (``--device-lane off|on|auto``)."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _dtype(text: str) -> str:
    from elixir_runtime.config import resolve_dtype

    try:
        resolve_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _gpu_memory(text: str) -> int:
    from elixir_runtime.config import ConfigError, ElixirConfig

    try:
        size = ElixirConfig(gpu_memory=text).gpu_memory_bytes
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert size is not None, "a size was given"
    return size


def _host_mem(text: str) -> int | str:
    from .hardware import host_mem

    return host_mem(text)


def _spec(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object ({exc}): {text!r}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"offload\": 0.5}}', got {text!r}")
    return spec


class _Parser(argparse.ArgumentParser):
    """argparse with bad input exiting ``EXIT_INPUT`` (its own 2 is ``EXIT_NO_FIT`` here)."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elixir-plan", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--model", "--model_config", "--model-config", dest="model", help="preset, config.json or Hub id")
    p.add_argument("--seq-len", "--seq_len", type=_positive, default=1024)
    p.add_argument("--batch-size", "--batch_size", type=_positive, default=8, help="per GPU")
    p.add_argument("--grad-accum", "--grad_accum", type=_positive, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gpus", type=_positive, default=1, help="GPUs (ranks) on one host")
    p.add_argument("--gpu-mem", "--gpu_mem", type=parse_size, help="memory per GPU (default: the hardware profile's)")
    p.add_argument(
        "--gpu-memory",
        "--gpu_memory",
        type=_gpu_memory,
        help="ElixirConfig.gpu_memory: the most GPU memory "
        "the run may use per GPU (a GPU shared with other jobs, headroom); at most the card's",
    )
    p.add_argument(
        "--host-mem",
        "--host_mem",
        type=_host_mem,
        help="host RAM available to the job before its model is loaded (what prepare counts: MemAvailable "
        "plus what the model's own weights free), or 'here': what this machine has available (default: this "
        "machine's when planning for its own GPU; else the GPU profile's host's, times the GPUs per GPU of it "
        "for more GPUs than it had, said in the output)",
    )
    p.add_argument(
        "--host-cores",
        "--host_cores",
        type=_positive,
        metavar="N",
        help="CPU cores of the host the GPUs share: the CPU update of offloaded chunks is priced at the profile's "
        "rate for as many cores per GPU (default: the profile's host's, times the GPUs per GPU of it for more "
        "GPUs than it had)",
    )
    card = p.add_mutually_exclusive_group()
    card.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"plan for this card without owning it: {', '.join(CARDS)} ({REFERENCE}: measured; the others derived "
        f"from it and their published figures), in the {REFERENCE} box (its host RAM and CPU) unless --host-mem",
    )
    card.add_argument(
        "--hardware",
        help="a shipped card (as --gpu) or a hardware profile JSON (default: this "
        f"machine's GPU, measured once and cached; without a GPU the shipped {REFERENCE})",
    )
    p.add_argument(
        "--elixir",
        type=_spec,
        metavar="JSON",
        help="what the run's --elixir JSON asks of the engine, as it would (its keys: ElixirConfig's settings and "
        'the HF integration\'s, docs/hf.md), e.g. \'{"offload": 0.5, "n_blocks": "min"}\'; the flags below '
        "that name a key are shorthands for it",
    )
    p.add_argument("--dtype", type=_dtype, help="compute dtype: bf16 (default), fp16 or fp32 (the dtype key)")
    p.add_argument("--no-ac", dest="ac", action="store_false", help="without activation checkpointing")
    p.add_argument(
        "--moments",
        choices=MOMENTS,
        help="how Adam's moments are stored (the moments key): fp32 (default, exact AdamW) or 8bit (fp32 master "
        "weights with block-wise 8-bit moments; an exact plan that offloads shows what 8bit would buy)",
    )
    p.add_argument(
        "--device-lane",
        choices=tuple(DEVICE_LANE_WORDS),
        help="the device update lane (ElixirConfig.device_assisted_update): off (default), on, or auto "
        "(kept where the predicted step is shorter)",
    )
    p.add_argument(
        "--stock-loss",
        "--stock_loss",
        dest="lean_loss",
        action="store_const",
        const=False,
        help="plan for transformers' own causal-LM loss (--elixir '{\"lean_loss\": false}'); default: the "
        "lean loss an Elixir run installs (elixir_hf/loss.py), without fp32 copies of the logits",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help=f"plan a LoRA fine-tune: the model wrapped by PEFT (needs peft: {PEFT_EXTRA}), its base frozen (its "
        "weights only: no gradients, no Adam state) and its adapters trained",
    )
    p.add_argument(
        "--lora-rank",
        "--lora_rank",
        type=_positive,
        metavar="R",
        help=f"the adapters' rank (default {LORA_RANK}; implies --lora)",
    )
    p.add_argument(
        "--lora-targets",
        "--lora_targets",
        type=lora_targets,
        metavar="NAMES",
        help=f"the modules the adapters wrap, comma-separated, e.g. q_proj,v_proj (default {LORA_TARGETS}: every "
        "linear layer but the head; implies --lora)",
    )
    p.add_argument("--exact", action="store_true", help="trace every block instead of replaying identical ones")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the planner's workings: the profile, "
        "the memory budget formula, I(n)/J(n), the rigid alternatives and every chunk size tried",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="draw GPU and host memory and which layers each chunk holds (on the GPU or offloaded) into this PNG file",
    )
    p.add_argument(
        "--measure-hardware",
        metavar="PATH",
        help="measure this machine, write its profile to PATH, exit "
        "(CPU Adam per rank for 1, 2, 4, 8 and all its GPUs' ranks, each count by as many processes at once)",
    )
    p.add_argument(
        "--run",
        metavar="OUTPUT_DIR",
        help="an Elixir Trainer run (its --output_dir) against its plan, per rank: predicted and measured step "
        "time and its phases, GPU peak, host memory; a table, and a PNG into OUTPUT_DIR/elixir_run (or --plot "
        "PNG; with matplotlib); takes --plot and --json only",
    )
    return p


def main(argv: Sequence[str] | None = None, *, profiles: Profiles | None = None) -> int:
    """``elixir-plan ARGV``; its exit code. ``profiles``: steps profiled by earlier calls in this process
    (``report.plan_report``), for a script that plans one model for many boxes."""
    parser = _parser()
    args = parser.parse_args(argv)
    _output_file(parser, "--plot", args.plot, "plan.png")
    _output_file(parser, "--measure-hardware", args.measure_hardware, "hw.json")
    if args.measure_hardware:
        _alone(parser, args, "--measure-hardware", "measures this machine and takes no other flag")
        return _measure(args.measure_hardware)
    if args.run:
        _alone(parser, args, "--run", "reads a run's records and takes --plot and --json only", "--plot", "--json")
        from .run import run_command

        return run_command(args.run, png=args.plot, as_json=args.json)
    if not args.model:
        parser.error("--model is required (or --measure-hardware, or --run)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the seconds of planning
        parser.error(f"--plot {args.plot} needs matplotlib: pip install 'elixir-hf[plot]'")
    if lora_of(args) and importlib.util.find_spec("peft") is None:
        parser.error(f"--lora needs peft: {PEFT_EXTRA}")
    from elixir_runtime.config import PlanError

    from ...plugin import ElixirSpecError
    from .hardware import plan_hardware
    from .report import plan_report

    try:
        hardware, note = plan_hardware(args)
    except ValueError as exc:  # names the value and the fix: no usage text around it
        print(f"elixir-plan: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        config = _elixir_config(args)
    except ElixirSpecError as exc:
        parser.error(str(exc))
    try:
        report = plan_report(args, config, hardware, note, profiles)
    except (PlanError, ValueError) as exc:
        code = EXIT_NO_FIT if isinstance(exc, PlanError) else EXIT_INPUT
        message = str(exc) if args.verbose else plain_words(str(exc))
        if args.json:
            print(json.dumps({"error": message, "exit": code}, indent=2))
        else:
            print(f"elixir-plan: {message}", file=sys.stderr)
        return code
    if args.json:
        print(json.dumps(report.doc, indent=2))
    else:
        more = report.details if args.verbose else "more: --verbose (the planner's workings), --plot FILE.png, --json"
        print(f"{report.text}\n\n{more}")
    for warning in report.warnings:  # after the text, where a reader's eye ends; in --json's document too
        print(f"elixir-plan: WARNING: {warning}", file=sys.stderr)
    if args.plot:
        from .plot import plot_plan  # matplotlib only when asked for

        plot_plan(report.plan, args.plot, title=report.title)
        # beside the JSON document, not in it: stdout stays one document
        print(f"plot written to {os.path.abspath(args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _output_file(parser: argparse.ArgumentParser, flag: str, path: str | None, example: str) -> None:
    """An error for a file ``flag`` cannot write, before the seconds of planning or minutes of measuring
    (else a traceback after them): its folder missing, a folder named, a plot not a PNG."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path} is a folder: name a file, e.g. {os.path.join(path, example)}")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist: create it, or name a file in one that does")
    if example.endswith(".png") and not path.lower().endswith(".png"):
        parser.error(f"{flag} {path}: the plot is a PNG: name a .png file")


def _alone(parser: argparse.ArgumentParser, args: argparse.Namespace, flag: str, does: str, *allowed: str) -> None:
    """An error naming the flags given beside ``flag`` but ``allowed`` (which it would ignore)."""
    default = vars(parser.parse_args([]))
    given = [
        a.option_strings[0] for a in parser._actions if a.dest in default and getattr(args, a.dest) != default[a.dest]
    ]
    if extra := [f for f in given if f not in (flag, *allowed)]:
        parser.error(f"{flag} {does}, not {', '.join(extra)}")


_BUDGET = re.compile(r"U_allowed = (.+?) = (\S+ \S+) per rank")


def plain_words(message: str) -> str:
    """The planner's message without its symbols (``--verbose`` keeps them): the GPU memory budget's
    formula as what is left for the model states."""
    return _BUDGET.sub(
        r"only \2 per GPU is left for them (\1: a share of the GPU less buffers and activations)", message
    )


_SHORTHANDS: dict[str, tuple[str, str, Callable[[Any], object]]] = {
    # flag: (its attribute, the --elixir key it sets, that key's value from the flag's)
    "--dtype": ("dtype", "dtype", str),
    "--gpu-memory": ("gpu_memory", "gpu_memory", int),
    "--device-lane": ("device_lane", "device_assisted_update", DEVICE_LANE_WORDS.__getitem__),
    "--stock-loss": ("lean_loss", "lean_loss", bool),
    "--moments": ("moments", "moments", str),
}
"""The flags that are shorthands for an ``--elixir`` key."""


def _elixir_config(args: argparse.Namespace) -> ElixirConfig:
    """What the command line asks of the engine, parsed as the run's ``--elixir`` is (``ElixirPlugin``:
    the keys ``ElixirConfig.settings()`` marks, and the plugin's): ``--elixir`` with the shorthand
    flags' keys added (one given both ways with two values is an error); ``args``' ``dtype``,
    ``gpu_memory`` and ``lean_loss`` become what it resolves to, which the report reads."""
    from ...plugin import ElixirPlugin, ElixirSpecError

    spec = dict(args.elixir or {})
    for flag, (attr, key, value) in _SHORTHANDS.items():
        given = getattr(args, attr)
        if given is None:
            continue
        if key in spec and spec[key] != value(given):
            raise ElixirSpecError(f"{flag} says {key} {value(given)!r}, --elixir says {spec[key]!r}: give it once")
        spec[key] = value(given)
    plugin = ElixirPlugin.from_spec({"dtype": "bf16", **spec}, source="elixir-plan --elixir")
    assert plugin is not None, "a mapping is never 'off'"
    if plugin.plan is not None or plugin.config.mode != "auto":
        raise ElixirSpecError(
            "elixir-plan --elixir takes the settings of an auto plan, not a plan or mode 'static': elixir-plan makes "
            "the plan --elixir auto would"
        )
    if not args.ac and plugin.config.activations == "host":
        raise ElixirSpecError(
            "--no-ac with activations 'host': the host holds block inputs only for a recompute under activation "
            "checkpointing; drop --no-ac, or set activations 'auto' or 'device'"
        )
    config = dataclasses.replace(plugin.config, grad_accum_steps=args.grad_accum)
    args.dtype, args.gpu_memory, args.lean_loss = config.dtype, config.gpu_memory, plugin.lean_loss
    return config


def _measure(path: str) -> int:
    from elixir_runtime.hardware import measure_hardware

    profile = measure_hardware()
    profile.save(path)
    print(profile.to_json())
    print(f"written to {path} ({profile.source})", file=sys.stderr)
    return 0
