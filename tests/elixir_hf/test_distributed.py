"""Two ranks (torchrun, CPU, gloo): ElixirTrainer matches the stock Trainer under DDP, a 2-rank
checkpoint resumes with the same losses, a model loaded on rank 0 only trains the same, the
consolidated model equals DDP's, each rank records the run against its plan, and Elixir's log lines
and progress bars follow --log_level, --log_level_replica and --disable_tqdm (resuming on another
number of ranks: tests/reliability/test_resume_change.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from hf_cases import VOCAB
from transformers import AutoModelForCausalLM

from elixir_hf.run_record import read_run, record_dir
from elixir_hf.run_report import run_table
from helpers.lifetime import die_with_parent
from helpers.models import ATTN_IMPL, make_batch

WORKER = Path(__file__).with_name("dist_worker.py")
RTOL = 1e-5


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    env.pop("ELIXIR_CONFIG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    cmd.append(str(out))
    # torchrun ends its ranks on SIGTERM, which it gets when this test process exits (and they on its exit)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop_with_stacks(proc, out)
        stacks = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(out.glob("stacks-rank*.txt")))
        pytest.fail(f"2-rank run timed out; output:\n{stdout[-3000:]}\n{stderr[-4000:]}\nthe ranks' stacks:\n{stacks}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return out, json.loads((out / "result.json").read_text())


def _stop_with_stacks(proc: subprocess.Popen, out: Path) -> tuple[str, str]:
    """Asks every rank for its threads' stacks (the worker's faulthandler), waits until each rank's file
    holds them (at most 30 s: a rank hung outside Python never writes), then kills torchrun and its
    ranks (which run in sessions of their own, out of reach of a process-group kill)."""
    tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in tree[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(p.stat().st_size for p in out.glob("stacks-rank*.txt")):
        time.sleep(0.1)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return proc.communicate()


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) > 0, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=RTOL), f"{what}[{i}]: {g} vs {w}"


def test_two_ranks_match_ddp(two_rank_run) -> None:
    _, result = two_rank_run
    assert result["world_size"] == 2
    for key in ("loss", "grad_norm", "eval_loss"):
        _close(result["elixir"][key], result["ddp"][key], key)


SAVE_BARS = [
    "elixir: gathering the weights",
    "elixir: summing the checkpoint's files",
    "elixir: summing optimizer",
    "elixir: writing",  # OPTIMIZER_README.md (dist_worker.py reads the lowercase words of a bar's name)
    "elixir: writing elixir",
    "elixir: writing optimizer",
    "elixir: writing scheduler",
]
FILL_BARS = ["elixir: filling device chunk shards", "elixir: filling host chunk shards"]


def test_log_lines_and_bars_follow_the_trainers_flags(two_rank_run) -> None:
    """The plan and the lean-loss line: INFO, at --log_level on rank 0 and --log_level_replica on
    rank 1 (default warning). Bars: rank 0 only, none with --disable_tqdm (the runs' flags:
    dist_worker.py). In an Accelerate loop at INFO everywhere, rank 1 stays at WARNING."""
    _, result = two_rank_run
    rank0, rank1 = result["shown"]
    none = {"plan": 0, "lean_loss": 0, "bars": []}
    assert rank0["info"] == {"plan": 1, "lean_loss": 1, "bars": sorted(FILL_BARS + SAVE_BARS)}
    assert rank1["info"] == none
    verify = ["elixir: verifying the checkpoint"]
    assert rank0["warning"] == {"plan": 0, "lean_loss": 0, "bars": sorted(FILL_BARS + SAVE_BARS + verify)}
    assert rank1["warning"] == none
    assert rank0["replica_info"] == rank1["replica_info"] == {"plan": 1, "lean_loss": 1, "bars": []}  # --disable_tqdm
    assert rank0["accelerate_info"] == {
        "plan": 2,
        "lean_loss": 2,
        "bars": FILL_BARS + ["elixir: gathering the weights"],
    }
    assert rank1["accelerate_info"] == none


def test_each_rank_records_the_run_against_its_plan(two_rank_run) -> None:
    """Both ranks' elixir/* values in OUTPUT_DIR/elixir_run, of the last run in the folder (the resume
    of the streamed model: steps 5-8), and the table of them the end of that run wrote, per rank."""
    out, _ = two_rank_run
    folder = out / "elixir"
    records = read_run(folder)
    assert [(r.rank, r.world_size) for r in records] == [(0, 2), (1, 2)]
    assert all([log["step"] for log in r.logs] == [5, 6, 7, 8] for r in records)
    table = run_table(records, folder)
    rss = next(row for row in table.rows if row.compared.run == "elixir/host_rss_gib")
    assert rss.ranks == [max(log["elixir/host_rss_gib"] for log in r.logs) for r in records]
    assert rss.plan == records[0].logs[-1]["elixir/plan_host_gib"] > 0  # half the chunks offloaded
    written = (record_dir(folder) / "run_vs_plan.txt").read_text().splitlines()
    assert written[1].split() == ["plan", "rank", "0", "rank", "1"]
    assert written[1:] == table.text().splitlines()[1:]
    assert (record_dir(folder) / "run_vs_plan.png").stat().st_size > 0


def test_two_rank_resume_gives_the_same_losses(two_rank_run) -> None:
    _, result = two_rank_run
    assert result["resumed"]["loss"] == result["elixir"]["loss"]
    assert result["resumed"]["eval_loss"] == result["elixir"]["eval_loss"]


def test_loading_on_rank_0_only_trains_the_same(two_rank_run) -> None:
    """``elixir_hf.from_pretrained(..., stream=False)``: rank 1 holds no weights (meta), yet trains
    exactly as when every rank loaded them: the engine filled its shards from rank 0. Streamed (every
    rank on meta) and resumed: the checkpoint's files replace the source, as the all-ranks resume."""
    _, result = two_rank_run
    assert result["loaded_on_meta"] == [False, True]
    assert result["streamed_on_meta"] == [True, True]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert result["from_rank0"][key] == result["elixir"][key], key
        assert result["from_rank0_resumed"][key] == result["resumed"][key], key


def test_accelerate_loop_with_rank_1_on_meta_trains_the_same(two_rank_run) -> None:
    _, result = two_rank_run
    with_weights, on_meta = result["accelerate"]
    assert len(with_weights) == 6 and on_meta == with_weights  # 24 samples, batches of 2, over 2 ranks
    assert result["accelerate_weight_diff"] == 0.0


def test_two_rank_model_equals_ddp_model(two_rank_run) -> None:
    out, _ = two_rank_run
    ids = make_batch(VOCAB)["input_ids"]
    logits = {}
    for name in ("elixir_final", "ddp_final"):
        model = AutoModelForCausalLM.from_pretrained(str(out / name), attn_implementation=ATTN_IMPL).eval()
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    torch.testing.assert_close(logits["elixir_final"], logits["ddp_final"], rtol=0, atol=1e-4)


def test_generate_callback_on_rank_0_of_two(two_rank_run) -> None:
    """``GenerateCallback``: rank 0 sampled alone at steps 4 and 8 of the Elixir run (whose losses
    match DDP's above), and the last sample is what the saved final model generates."""
    out, result = two_rank_run
    assert [step for step, _ in result["samples"]] == [4, 8]
    model = AutoModelForCausalLM.from_pretrained(str(out / "elixir_final"), attn_implementation=ATTN_IMPL).eval()
    prompt = torch.tensor([[5, 17, 3, 9], [8, 8, 40, 2]])
    want = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert result["samples"][-1][1] == want.tolist()
