"""``benchmarks.build``: a checkpoint written once, then the build timed and its host peak reported
as JSON, streamed and not (1 rank, CPU)."""

from __future__ import annotations

import json

from benchmarks.build import main


def test_build_reports_time_and_host_peak(tmp_path, capsys) -> None:
    folder = str(tmp_path / "tiny")
    main(["write", "--model", "tiny", "--dtype", "fp32", "--out", folder, "--max-shard-size", "10MB"])
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert written["params"] > 0
    for flag in ("--stream", "--no-stream"):
        main(
            [
                "run",
                "--folder",
                folder,
                "--dtype",
                "fp32",
                "--seq",
                "32",
                "--batch-size",
                "1",
                flag,
                "--elixir",
                '{"mode": "static"}',
            ]
        )
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert record["stream"] is (flag == "--stream") and record["world_size"] == 1
        assert record["build_s"] >= record["prepare_s"] > 0 and record["rss_peak_per_rank_GiB"][0] > 0
