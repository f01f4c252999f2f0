"""``python -m elixir_hf.commands.env``: the report's keys, the kernel it says offloaded chunks get, and why
when that is the torch fallback. (An installed wheel's report: test_install.py.)"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from elixir_hf.commands.env import main as env_main
from elixir_hf.commands.env import report as env
from elixir_runtime.kernels import cpu_adam

VERSION = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture
def fresh_kernel():
    """The report builds/loads the C++ kernel once per process: forget it around the test."""
    cpu_adam._load.cache_clear()
    yield
    cpu_adam._load.cache_clear()


def test_json_report(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELIXIR_ADAM_KERNEL", raising=False)
    assert env_main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == VERSION
    assert report["cpu_adam"] == "cpp", report["cpu_adam_detail"]
    assert report["triton_adam"] in ("triton", "torch") and report["triton_adam_detail"]
    assert isinstance(report["gpus"], list) and report["host_memory_gib"] > 0 and report["cpu_cores"] >= 1
    assert {"torch", "transformers", "accelerate", "triton", "hardware_profile"} <= report.keys()


def test_text_report(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELIXIR_HARDWARE", "h100")
    assert env_main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"elixir-hf         {VERSION} (")
    assert "CPU Adam" in out and "the shipped profile 'h100' (ELIXIR_HARDWARE)" in out


def test_broken_compiler_reports_torch_and_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path, fresh_kernel) -> None:
    monkeypatch.delenv("ELIXIR_ADAM_KERNEL", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    report = env.environment()
    assert report["cpu_adam"] == "torch"
    assert "failed" in report["cpu_adam_detail"] and "Fix: install g++ with OpenMP" in report["cpu_adam_detail"]


def test_forced_torch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELIXIR_ADAM_KERNEL", "torch")
    report = env.environment()
    assert (report["cpu_adam"], report["cpu_adam_detail"]) == ("torch", "ELIXIR_ADAM_KERNEL=torch")
    assert report["triton_adam"] == "torch"


def test_the_rates_jobs_recorded_here_are_reported(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """This machine's cached profile, with the CPU update rate a job recorded in it
    (docs/planning.md, "The run's own rate"), and how to start over."""
    import dataclasses

    from elixir_runtime.hardware.profile import CpuAdamRate
    from tests.elixir_runtime.search.search_cases import gpu_host

    monkeypatch.delenv("ELIXIR_HARDWARE", raising=False)
    monkeypatch.setattr(env.torch.cuda, "is_available", lambda: True)
    path = tmp_path / "hardware-this.json"
    monkeypatch.setattr(env, "cache_path", lambda: path)
    measured = dataclasses.replace(
        gpu_host(), cpu_adam={1: CpuAdamRate(1, 15, 3e9, 5e9), 2: CpuAdamRate(2, 7, 2e9, 3e9)}
    )
    measured.save(path)
    assert env._hardware_profile() == f"this machine's, cached at {path} (delete it to measure again)"
    measured.cpu_adam[2].observed = 2.5e9
    measured.save(path)
    assert env._hardware_profile().endswith(
        "CPU updates of offloaded chunks ran here at 2.50 with 2 per host (G params/s per rank)"
    )
    path.write_text('{"links": []}')  # JSON, but no profile
    assert "unreadable" in env._hardware_profile() and "measures it again" in env._hardware_profile()


def test_torchs_no_cuda_runtime_warning_is_not_passed_on(monkeypatch, caplog) -> None:
    """A CUDA wheel without a GPU: cpp_extension's "No CUDA runtime is found, using CUDA_HOME" (logged
    while the C++ Adam's status is read) does not reach the report's reader (issue 50, 5)."""
    import logging

    status = env.cpu_kernel_status

    def noisy() -> tuple[str, str]:
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/x")
        logging.getLogger("torch.utils.cpp_extension").warning("another warning")
        return status()

    monkeypatch.setattr(env, "cpu_kernel_status", noisy)
    with caplog.at_level(logging.WARNING):
        assert env_main(["--json"]) == 0
    assert "No CUDA runtime" not in caplog.text and "another warning" in caplog.text
