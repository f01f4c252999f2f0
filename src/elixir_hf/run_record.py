"""A run's own numbers beside its plan, one file per rank: what ``elixir-plan --run`` reads.

``OUTPUT_DIR/elixir_run/rank{N}.json`` holds rank N's ``elixir/*`` values of every training log
(``metrics.py``: measured, and the plan's predictions of them), rewritten whole at each log and at
the end of training (``callback.RunRecorder``); at the end, the saving process also writes every
other rank's, so a folder on one node's disk holds them all. A new run in the folder replaces them.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RECORD_DIR",
    "REPORT",
    "RankRecord",
    "RunRecordError",
    "new_run",
    "read_run",
    "record_dir",
    "replace_file",
    "write_record",
]

RECORD_DIR = "elixir_run"
REPORT = "run_vs_plan"
"""The run against its plan, beside the records: ``run_vs_plan.txt`` and ``run_vs_plan.png``."""


class RunRecordError(ValueError):
    """A folder without a readable run record; the message names the fix."""


@dataclass
class RankRecord:
    rank: int
    world_size: int
    host: str = field(default_factory=socket.gethostname)
    device: str = "cpu"
    logs: list[dict[str, float]] = field(default_factory=list)
    """Each training log's ``elixir/*`` values and its optimizer ``step``."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankRecord:
        return cls(**data)


def record_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / RECORD_DIR


def write_record(output_dir: str | os.PathLike[str], record: RankRecord) -> None:
    """Rank ``record.rank``'s file."""
    folder = record_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    replace_file(folder / f"rank{record.rank}.json", lambda tmp: tmp.write_text(json.dumps(asdict(record), indent=1)))


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """``path`` replaced whole by what ``write`` puts in a file beside it (of the same suffix): a reader never
    sees half of one, and processes writing the same file (nodes sharing a folder) never mix theirs."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def new_run(output_dir: str | os.PathLike[str], world_size: int) -> None:
    """What an earlier run left in the folder that this one will not replace: the records of its ranks
    past ``world_size`` and its report (by the saving process, as the ranks write their first records)."""
    folder = record_dir(output_dir)
    stale = [path for rank, path in _rank_files(folder) if rank >= world_size]
    for path in [*stale, *folder.glob(f"{REPORT}.*")]:
        path.unlink(missing_ok=True)


def read_run(output_dir: str | os.PathLike[str]) -> list[RankRecord]:
    """Every rank's record of the run in ``output_dir``, by rank; ``RunRecordError`` naming the fix when
    there is none, or none with a training log."""
    out = Path(output_dir)
    if not out.is_dir():
        raise RunRecordError(f"{out}: no such folder (give the run's --output_dir)")
    paths = [path for _, path in _rank_files(record_dir(out))]
    if not paths:
        raise RunRecordError(
            f"{out} holds no Elixir run record ({RECORD_DIR}/rank*.json): an Elixir Trainer run (--elixir auto, "
            "ElixirTrainer) writes one per rank into its --output_dir at each training log; give that folder, "
            "or train again with this version of elixir-hf"
        )
    records = []
    for path in paths:
        try:
            records.append(RankRecord.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as exc:
            raise RunRecordError(f"{path}: not a run record ({exc}); remove it or train again") from None
    if len({r.world_size for r in records}) > 1:
        raise RunRecordError(
            f"{record_dir(out)}: records of runs with different rank counts; remove the folder and train again"
        )
    records.sort(key=lambda r: r.rank)
    if not any(r.logs for r in records):
        raise RunRecordError(
            f"{out}: the run has logged no training step yet; its first log comes at --logging_steps "
            "(and one at the end of training)"
        )
    return records


def _rank_files(folder: Path) -> list[tuple[int, Path]]:
    found = ((path.stem.removeprefix("rank"), path) for path in folder.glob("rank*.json"))
    return sorted((int(rank), path) for rank, path in found if rank.isdigit())
