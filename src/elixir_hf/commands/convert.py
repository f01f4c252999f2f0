"""``elixir-convert CHECKPOINT OUT`` (``python -m elixir_hf.commands.convert``): the command line of
``checkpoint/convert.py``, which says what ``OUT`` holds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import __version__

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="elixir-convert",
        description="Write an Elixir checkpoint as a plain PyTorch one: the fp32 model (from_pretrained) and "
        "a torch.optim.AdamW state_dict (optimizer.pt) in model.parameters() order, with the other Trainer files.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("checkpoint", help="an Elixir checkpoint folder (checkpoint-N, or a save_state folder)")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--config", help="the model's config (folder or name) when the checkpoint has no config.json")
    parser.add_argument("--overwrite", action="store_true", help="write into OUT though it holds files")
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).is_dir():
        parser.error(
            f"CHECKPOINT {args.checkpoint}: no such folder (a checkpoint-N folder of an Elixir run's output_dir)"
        )
    from ..checkpoint.convert import convert  # torch: after the command line, so --help answers without it
    from ..checkpoint.format import CheckpointError

    try:
        convert(args.checkpoint, args.out, args.config, overwrite=args.overwrite)
    except (CheckpointError, OSError) as e:
        sys.exit(f"elixir-convert: {e}")
    print(f"elixir-convert: wrote {args.out} (model.safetensors, config.json, optimizer.pt)")


if __name__ == "__main__":
    main()
