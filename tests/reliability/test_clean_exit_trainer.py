"""A 2-rank Trainer job under ``torchrun`` ends with exit code 0 and no ``terminate called`` (see
``test_clean_exit.py``; the bare-collectives loop there, 4 runs, is the sharper detector: 6 in 30
aborted before the fix). One job by default; ``ELIXIR_LONG_TESTS=1`` runs 50."""

from __future__ import annotations

from launch import LONG, assert_clean_exits, run_script


def test_trainer_job_exits_cleanly(tmp_path) -> None:
    assert_clean_exits(
        [run_script("exit_worker.py", str(tmp_path / str(i)), ranks=2) for i in range(50 if LONG else 1)]
    )
