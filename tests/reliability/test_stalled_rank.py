"""A rank that stops answering is named: rank 1 of a 2-rank Trainer job stops (SIGSTOP) in a
forward or inside a save, and rank 0 ends within the lockstep timeout (3 s) with exit status 69 and
the Elixir message naming rank 1, its pid and host; the default group's timeout is ``--ddp_timeout``
on gloo too. Before: rank 0 waited in the save's gather until the default group's timeout, 30
minutes on CPU whatever ``--ddp_timeout`` said, then failed naming no rank; in a forward, the
check-in said the ranks were not starting the same operation and blamed a rank-local forward."""

from __future__ import annotations

import json
import re

import pytest
from launch import run_script
from stall_worker import DDP_TIMEOUT

from elixir_runtime.distributed.heartbeat import EXIT_STALLED


@pytest.mark.parametrize("where", ["forward", "save"])
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path, where: str) -> None:
    proc = run_script("stall_worker.py", str(tmp_path), where, ranks=2, timeout=120)  # the bound: 120 s
    assert (tmp_path / "stopping").is_file(), proc.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["ddp_timeout_s"] == DDP_TIMEOUT
    (verdict,) = re.findall(r"^\[rank 0\] (Elixir: a rank stopped answering.*)$", proc.stderr, flags=re.M)
    assert re.search(r"\(rank 1 \(pid \d+ on [^)]+\) for \d+\.\d s; ElixirConfig.lockstep_timeout_s=3\)", verdict)
    assert f"every rank stops (exit status {EXIT_STALLED})" in verdict
    assert re.search(rf"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: {EXIT_STALLED} ", proc.stderr), proc.stderr[
        -3000:
    ]
