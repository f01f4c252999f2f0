"""Launch mistakes (``elixir_hf/launch.py``): one message per job naming the fix, before any model
state is built, without a traceback per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from elixir_hf import ElixirAccelerator, ElixirTrainingArguments, launch
from elixir_hf.launch import LaunchError, check_devices, check_launch
from helpers.models import tiny_gpt2

ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _launched_as_rank_0_of_2_without_a_gpu(monkeypatch: pytest.MonkeyPatch):
    """What ``accelerate launch`` / torchrun give each process of 2 on a host whose GPUs are hidden."""
    for var in ("ELIXIR_CONFIG", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    AcceleratorState._reset_state(reset_partial_state=True)  # no devices picked yet, as in a fresh process
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_no_gpu_and_no_cpu_flag_stops_the_accelerator_before_accelerate_builds_its_state() -> None:
    with pytest.raises(LaunchError) as exc:
        ElixirAccelerator(elixir_plugin="auto")
    message = str(exc.value.code)
    assert message.startswith("elixir-hf: 2 processes were launched, but they see no GPU (CUDA_VISIBLE_DEVICES='')")
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in message
    assert "ElixirAccelerator(cpu=True)" in message and "check CUDA_VISIBLE_DEVICES" in message
    assert not AcceleratorState._shared_state  # stopped before Accelerate chose devices


def test_the_trainer_is_stopped_at_its_arguments_before_transformers_checks_bf16(tmp_path) -> None:
    """Without the check, transformers would fail on ``--bf16`` ("Your setup doesn't support bf16/gpu")."""
    with pytest.raises(
        LaunchError, match=r"(?s)the Trainer was not told to run on the CPU.*--use_cpu in its arguments"
    ):
        ElixirTrainingArguments(output_dir=str(tmp_path), elixir="auto", bf16=True, report_to=[])


def test_a_cpu_job_told_so_passes(monkeypatch) -> None:
    check_devices("Accelerator", cpu=True)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    check_devices("Trainer", cpu=False)


def test_the_other_ranks_leave_the_message_to_rank_0(monkeypatch) -> None:
    """Every rank makes the same mistake: rank 1 waits for the launcher to stop it and exits silently."""
    waited: list[float] = []
    monkeypatch.setattr(launch.time, "sleep", waited.append)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(LaunchError) as exc:
        check_devices("Accelerator", cpu=False)
    assert exc.value.code == 1 and waited == [launch.QUIET_RANK_WAIT_S]


def test_a_rank_without_a_gpu_of_its_own_says_so(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for var, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "3")):
        monkeypatch.setenv(var, value)
    with pytest.raises(
        LaunchError,
        match=r"rank 3 \(local rank 3\) has no GPU of its own: this host shows 2 GPU\(s\) "
        r"\(CUDA_VISIBLE_DEVICES='0,1'\) to 4 processes.*--num_processes 2",
    ):
        check_devices("Trainer", cpu=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_devices("Trainer", cpu=False)


def test_launch_check_compares_the_launched_ranks(monkeypatch) -> None:
    """After Accelerate's state: the rule both the arguments and ``ElixirAccelerator`` apply
    (torchrun's ``WORLD_SIZE`` when no process group exists yet)."""
    with pytest.raises(LaunchError, match="2 processes were launched, but they see no GPU"):
        check_launch(1, "Accelerator")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(LaunchError, match="2 processes were launched but the Trainer counts 1"):
        check_launch(1, "Trainer")
    check_launch(2)


@pytest.mark.once  # accelerate's launcher, not transformers code: the newest transformers only
def test_accelerate_launch_of_2_cpu_processes_without_use_cpu_says_it_once(tmp_path) -> None:
    """The mistake as a user makes it: ``accelerate launch`` with a 2-GPU config on a host without
    GPUs, a Trainer script without --use_cpu, through ``elixir-run``. One message, from rank 0; no
    traceback from the ranks (the launcher's own report of the failed job follows)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    for var in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK"):  # the launcher's to set, not this test's fixture
        env.pop(var, None)
    tiny_gpt2(vocab=128).save_pretrained(tmp_path / "model")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "elixir.yaml"),
        "-m",
        "elixir_hf.commands.run",
        str(ROOT / "tests" / "elixir_hf" / "commands" / "scripts" / "hf_trainer.py"),
        "--model_name_or_path",
        str(tmp_path / "model"),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert out.count("elixir-hf: 2 processes were launched, but they see no GPU") == 1, out[-3000:]
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 hf_trainer.py" in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out and "LaunchError" not in out, out[-3000:]
    assert "Elixir plan" not in out and not (tmp_path / "out" / "trainer_state.json").exists()
