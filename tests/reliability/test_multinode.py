"""Checkpoints of a job on 2 nodes, simulated on one machine (one rank per node, gloo, with the
environment ``torchrun --nnodes 2`` gives each: ``launch.run_ranks``): with a disk per node
(``save_on_each_node``) every node's checkpoint holds what its ranks need to resume (weights, config,
plan, its ranks' optimizer shards, scheduler, trainer state, RNG) and a marker of its own; on a
shared disk, one marker by the main process.
Both resume, and every run logs the losses of the same job on 1 node x 2 ranks (under ``torchrun``),
bit for bit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from launch import LONG, assert_clean_exits, run_ranks, run_script

from elixir_hf.checkpoint.format import MARKER_NAME, NOTE_NAME, OPTIM_INDEX, PLAN_NAME
from elixir_hf.checkpoint.optimizer_files import optim_file_name

WORKER = "nodes_worker.py"


def _two_nodes(folders: list[Path], resume: list[str], disks: str, ok: bool = True) -> list[str]:
    """Node ``i`` (one rank, global rank ``i``) writes to ``folders[i]`` and resumes from ``resume[i]``;
    each node's stderr."""
    nodes = [str(a) for pair in zip(folders, resume) for a in pair]
    ends = run_ranks(WORKER, disks, "-", *nodes, ranks=2, nodes=2)
    for node, end in enumerate(ends):
        assert (end.returncode == 0) == ok, f"node {node}:\n{end.stderr[-4000:]}"
    return [end.stderr for end in ends]


def _losses(folder: Path) -> list[float]:
    state = json.loads((folder / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _one_node(out: Path) -> subprocess.CompletedProcess:
    return run_script(WORKER, "shared", "final", str(out), "-", ranks=2)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: the same job on 1 node x 2 ranks, one output folder. A ``run_clm.py``-style job
    (train, save the model, return from ``main``: no ``destroy_process_group``, no ``os._exit``), it
    also ends with exit code 0 and no ``terminate called`` (``test_clean_exit.py``; 50 such jobs with
    ``ELIXIR_LONG_TESTS=1``, as was done once before merging)."""
    out = tmp_path_factory.mktemp("one-node")
    more = [_one_node(tmp_path_factory.mktemp("exit")) for _ in range(49 if LONG else 0)]
    assert_clean_exits([_one_node(out), *more])
    assert len(_losses(out / "checkpoint-6")) == 6 and (out / "final" / "model.safetensors").is_file()
    return out


def test_node_local_disks_hold_a_whole_checkpoint_per_node_and_resume(one_node, tmp_path) -> None:
    """Before: node 1's checkpoint-4 held only its optimizer shard, marker and RNG state, and its
    resume failed ("Can't find a valid checkpoint"; gloo's "Connection closed by peer" on node 0)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    _two_nodes(nodes, ["-", "-"], "node-local")
    want = _losses(one_node / "checkpoint-6")
    for rank, folder in enumerate(nodes):
        ckpt = folder / "checkpoint-4"
        marker = json.loads((ckpt / MARKER_NAME).read_text())
        files = set(marker["files"])
        needed = {"model.safetensors", "config.json", PLAN_NAME, optim_file_name(rank, 2), OPTIM_INDEX}
        needed |= {"scheduler.pt", "trainer_state.json", f"rng_state_{rank}.pth"}
        assert needed <= files and optim_file_name(1 - rank, 2) not in files, (rank, sorted(files))
        assert files == {p.name for p in ckpt.iterdir()} - {MARKER_NAME, NOTE_NAME}, (rank, sorted(files))
        assert marker["world_size"] == 2 and marker["step"] == 4
        assert _losses(ckpt.parent / "checkpoint-6") == want, rank
        (ckpt.parent / "checkpoint-6").rename(ckpt.parent / "straight-6")

    _two_nodes(nodes, [str(n / "checkpoint-4") for n in nodes], "node-local")
    for folder in nodes:
        assert _losses(folder / "checkpoint-6") == want


def test_a_shared_disk_keeps_one_marker_and_resumes_on_two_nodes(one_node, tmp_path) -> None:
    """A checkpoint written by 1 node x 2 ranks resumes on 2 nodes x 1 rank sharing the folder."""
    shared = tmp_path / "shared"
    (shared / "checkpoint-4").parent.mkdir()
    subprocess.run(["cp", "-r", str(one_node / "checkpoint-4"), str(shared / "checkpoint-4")], check=True)
    marker = json.loads((shared / "checkpoint-4" / MARKER_NAME).read_text())
    assert {optim_file_name(0, 2), optim_file_name(1, 2), OPTIM_INDEX, "model.safetensors"} <= set(marker["files"])
    _two_nodes([shared, shared], [str(shared / "checkpoint-4")] * 2, "shared")
    assert _losses(shared / "checkpoint-6") == _losses(one_node / "checkpoint-6")
    assert sorted(p.name for p in shared.iterdir()) == ["checkpoint-4", "checkpoint-6", "elixir_run"]


def test_nodes_that_would_resume_from_different_steps_stop_before_loading(one_node, tmp_path) -> None:
    """A save completed on node 0 only (node 1's checkpoint-4 torn): with ``resume_from_checkpoint=True``
    each node picks its own newest complete checkpoint, and every rank refuses to go on from two steps."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
        for step in (2, 4):
            subprocess.run(["cp", "-r", str(one_node / f"checkpoint-{step}"), str(node)], check=True)
    (nodes[1] / "checkpoint-4" / MARKER_NAME).unlink()
    outs = _two_nodes(nodes, ["last", "last"], "node-local", ok=False)
    for out in outs:
        assert "the ranks would resume from different steps: rank 0: " in out, out[-3000:]
        assert f"{nodes[1] / 'checkpoint-2'} (step 2)" in out and "with a step every node has" in out
