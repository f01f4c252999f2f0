"""2-rank jobs end with exit code 0: a real ``torchrun`` job, looped, never prints ``terminate
called`` (SIGABRT at interpreter exit when gloo's worker thread frees Python-made tensors, see
``Collectives._run``). This file: the engine's bare collectives (no transformers, so ``make test``
runs it once); ``test_multinode.py``'s reference job: a Trainer job. A short loop by default;
``ELIXIR_LONG_TESTS=1`` runs 100 (50 of the Trainer job), as was done once before merging."""

from __future__ import annotations

from launch import LONG, assert_clean_exits, run_script


def test_engine_collectives_exit_cleanly() -> None:
    assert_clean_exits([run_script("collectives_worker.py", ranks=2) for _ in range(100 if LONG else 4)])
