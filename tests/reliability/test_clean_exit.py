"""2-rank jobs end with exit code 0: a job, looped, never prints ``terminate called`` (SIGABRT at
interpreter exit when gloo's worker thread frees Python-made tensors, see ``Collectives._run``). This
file: the engine's bare collectives, each rank's own exit (``run_ranks``; no transformers, so ``make
test`` runs it once); ``test_multinode.py``'s reference job: a Trainer job under a real ``torchrun``.
A short loop by default; ``ELIXIR_LONG_TESTS=1`` runs 100 (50 of the Trainer job), as was done once
before merging. And the ranks ``run_ranks`` forks die with what forked them."""

from __future__ import annotations

import signal

from launch import LONG, assert_clean_exits, run_ranks


def test_engine_collectives_exit_cleanly() -> None:
    assert_clean_exits([end for _ in range(100 if LONG else 4) for end in run_ranks("collectives_worker.py")])


def test_forked_ranks_die_with_their_parent() -> None:
    """An interrupted ``make test`` leaves no rank running: each rank gets SIGKILL when the process that
    forked it (``rank_zygote.py``'s child for the call, which dies with the zygote, which dies with the
    test process) exits."""
    ends = run_ranks("lifetime_worker.py")
    assert [e.returncode for e in ends] == [0, 0]
    assert all(f"death signal {int(signal.SIGKILL)}" in e.stderr for e in ends), [e.stderr for e in ends]
