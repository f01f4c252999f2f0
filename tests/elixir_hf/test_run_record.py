"""A Trainer run records each rank's ``elixir/*`` values in ``OUTPUT_DIR/elixir_run`` and ends with the
run against its plan: ``elixir-plan --run`` on its folder reads them, TensorBoard gets the grouped
charts once and the table, W&B the table and a chart per comparison (two ranks: test_distributed.py)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import types
from pathlib import Path

import pytest
from hf_cases import make_trainer, training_args
from transformers.integrations import TensorBoardCallback

from elixir_hf.callback import TENSORBOARD_GROUP, _to_wandb
from elixir_hf.commands.plan import main as plan_main
from elixir_hf.run_record import RankRecord, new_run, read_run, record_dir, write_record
from elixir_hf.run_report import NOT_DRAWN, drawable, run_table


class Writer:
    """A SummaryWriter that keeps its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args))


class TensorBoard(TensorBoardCallback):
    """transformers' TensorBoard callback (its on_train_begin, on_log, on_train_end) on a ``Writer``."""

    def __init__(self, folder: Path) -> None:  # the stock one needs tensorboard installed
        self._SummaryWriter, self.logging_dir, self.tb_writer = None, str(folder), Writer()
        self.writer = self.tb_writer  # on_train_end drops tb_writer


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, TensorBoard]:
    """5 optimizer steps, a log every 2: logs at steps 2 and 4, and the steps since (5) at the end."""
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer("gpt2", training_args(str(out), "auto", max_steps=5, logging_steps=2, eval_strategy="no"))
    tensorboard = TensorBoard(out / "tb")
    trainer.add_callback(tensorboard)
    trainer.train()
    return out, tensorboard


def test_each_log_is_recorded_with_the_plan_beside_it(run) -> None:
    out, _ = run
    (record,) = read_run(out)
    assert (record.rank, record.world_size, record.device) == (0, 1, "cpu")
    assert [log["step"] for log in record.logs] == [2, 4, 5]
    assert "elixir/plan_chunks" in record.logs[0] and "elixir/plan_chunks" not in record.logs[1]
    for log in record.logs:  # the plan's predictions in every log, beside what they predict
        assert {"elixir/step_s", "elixir/host_rss_gib", "elixir/plan_host_gib"} <= log.keys()


def test_the_run_against_its_plan_from_its_records(run, capsys) -> None:
    """``elixir-plan --run``: rows from the records (times: the median of the logs after the first;
    memory: the highest), the table the run wrote at its end, and the PNG."""
    out, _ = run
    png = record_dir(out) / "run_vs_plan.png"
    assert plan_main(["--run", str(out)]) == 0
    shown = capsys.readouterr().out
    logs = read_run(out)[0].logs
    step = statistics.median(log["elixir/step_s"] for log in logs[1:])
    rss = max(log["elixir/host_rss_gib"] for log in logs)
    lines = {line.split(",")[0]: line.split() for line in shown.splitlines()}
    assert lines["step time"][-1] == f"{step:.3g}" and lines["step time"][-2] == "-"  # CPU: no predicted time
    assert lines["host RSS / pinned shards"][-1] == f"{rss:.3g}"
    assert shown.splitlines()[1].split() == ["plan", "rank", "0"]
    table = (record_dir(out) / "run_vs_plan.txt").read_text()  # written by the run's end
    assert table.splitlines()[1:] == shown.splitlines()[1 : len(table.splitlines())]
    # a CPU run's static plan predicts nothing it measured: no plot of empty panels, and why (issue 50, 5)
    assert not drawable(run_table(read_run(out), out)) and NOT_DRAWN in shown and not png.exists()
    assert plan_main(["--run", str(out), "--plot", str(out / "run.png")]) == 0
    assert NOT_DRAWN in capsys.readouterr().out and not (out / "run.png").exists()


def test_tensorboard_gets_the_grouped_charts_once_and_the_table(run) -> None:
    _, tensorboard = run
    calls = tensorboard.writer.calls
    (layout,) = [args[0] for name, args in calls if name == "add_custom_scalars"]
    charts = layout[TENSORBOARD_GROUP]
    assert charts["step time, s"] == ["Multiline", ["train/elixir/step_s", "train/elixir/plan_step_s"]]
    assert "GPU peak, GiB" not in charts  # on the CPU: neither measured nor predicted
    scalars = {args[0] for name, args in calls if name == "add_scalar"}
    assert {"train/elixir/step_s", "train/elixir/plan_host_gib"} <= scalars  # the tags the charts name
    texts = [args for name, args in calls if name == "add_text" and args[0] == TENSORBOARD_GROUP]
    assert len(texts) == 1 and "host RSS / pinned shards" in texts[0][1]
    assert [name for name, _ in calls][-1] == "close"  # the table came before TensorBoard closed


def _records() -> list[RankRecord]:
    """Two ranks of a searched GPU plan: 0.5 s predicted, 40 GiB peak, 8 GiB pinned."""
    plan = {"elixir/plan_step_s": 0.5, "elixir/plan_gpu_peak_gib": 40.0, "elixir/plan_host_gib": 8.0}
    out = []
    for rank, (steps, peaks) in enumerate(
        [([0.9, 0.6, 0.5, 0.55], [38, 41, 39, 40]), ([1.0, 0.7, 0.6, 0.6], [39, 39, 42, 39])]
    ):
        logs = [
            {
                "step": 10 * (i + 1),
                "elixir/step_s": s,
                "elixir/gpu_peak_gib": p,
                "elixir/host_rss_gib": 9.0 + rank,
                **plan,
            }
            for i, (s, p) in enumerate(zip(steps, peaks))
        ]
        out.append(RankRecord(rank=rank, world_size=2, device=f"cuda:{rank}", logs=logs))
    return out


def test_ranks_are_merged_into_one_table(tmp_path, capsys) -> None:
    for record in reversed(_records()):
        write_record(tmp_path, record)
    records = read_run(tmp_path)
    assert [r.rank for r in records] == [0, 1]
    table = run_table(records, tmp_path)
    rows = {row.compared.label: (row.plan, row.ranks) for row in table.rows}
    assert rows == {
        "step time": (0.5, [0.55, 0.6]),  # the median of the logs after the first
        "GPU peak": (40.0, [41, 42]),
        "host RSS / pinned shards": (8.0, [9.0, 10.0]),
    }
    assert "0.55 (1.10x)" in table.text() and "42 (1.05x)" in table.text()
    assert plan_main(["--run", str(tmp_path), "--json", "--plot", str(tmp_path / "run.png")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["device"] for r in doc["ranks"]] == ["cuda:0", "cuda:1"] and doc["rows"][1]["ranks"] == [41, 42]
    assert (tmp_path / "run.png").stat().st_size > 0 and drawable(table)


def test_a_new_run_removes_what_a_larger_one_left(tmp_path) -> None:
    for record in _records():
        write_record(tmp_path, record)
    (record_dir(tmp_path) / "run_vs_plan.txt").write_text("old")
    new_run(tmp_path, world_size=1)
    assert sorted(p.name for p in record_dir(tmp_path).iterdir()) == ["rank0.json"]


@pytest.mark.parametrize("case", ["no folder", "no records", "no logs", "not a record"])
def test_a_folder_without_a_run_names_the_fix(tmp_path, capsys, case: str) -> None:
    folder = tmp_path / "out"
    if case != "no folder":
        folder.mkdir()
    if case == "no logs":
        write_record(folder, RankRecord(rank=0, world_size=1))
    if case == "not a record":
        record_dir(folder).mkdir()
        (record_dir(folder) / "rank0.json").write_text("{")
    assert plan_main(["--run", str(folder)]) == 1  # bad input (plan.EXIT_INPUT)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    want = {
        "no folder": "no such folder (give the run's --output_dir)",
        "no records": "holds no Elixir run record (elixir_run/rank*.json)",
        "no logs": "the run has logged no training step yet",
        "not a record": "rank0.json: not a run record",
    }[case]
    assert err.startswith(f"elixir-plan: --run {folder}") and want in err, err


def test_without_matplotlib_the_table_and_the_extra(tmp_path, capsys, monkeypatch) -> None:
    for record in _records():
        write_record(tmp_path, record)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    assert plan_main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step time, s" in out and "the plot needs matplotlib: pip install 'elixir-hf[plot]'" in out
    assert not list(record_dir(tmp_path).glob("*.png"))
    assert plan_main(["--run", str(tmp_path), "--plot", str(tmp_path / "run.png")]) == 1  # an error: EXIT_INPUT
    assert "--plot" in capsys.readouterr().err


def test_run_takes_no_planning_options(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        plan_main(["--run", str(tmp_path), "--gpus", "2", "--no-ac"])
    assert exit.value.code == 1 and "takes --plot and --json only, not --gpus, --no-ac" in capsys.readouterr().err


def test_wandb_gets_the_table_and_a_chart_per_comparison(monkeypatch, tmp_path) -> None:
    logged: list[dict] = []
    wandb = types.SimpleNamespace(
        run=types.SimpleNamespace(log=logged.append),
        Table=lambda columns, data: ("table", columns, data),
        plot=types.SimpleNamespace(line_series=lambda **kw: ("chart", kw)),
    )
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    _to_wandb(run_table(_records(), tmp_path))
    (charts,) = logged
    assert charts["elixir/run_vs_plan"] == (
        "table",
        ["", "plan", "rank 0", "rank 1"],
        [
            ["step time, s", 0.5, 0.55, 0.6],
            ["GPU peak, GiB", 40.0, 41, 42],
            ["host RSS / pinned shards, GiB", 8.0, 9.0, 10.0],
        ],
    )
    _, step = charts["elixir/run_vs_plan/step time"]
    assert step["keys"] == ["rank 0", "rank 1", "plan"] and step["ys"][0] == [0.9, 0.6, 0.5, 0.55]
    assert step["ys"][2] == [0.5] * 4 and step["xs"][0] == [10, 20, 30, 40]
