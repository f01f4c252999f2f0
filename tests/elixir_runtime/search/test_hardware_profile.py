"""Hardware profile: measured on this (CPU) machine, cached, overridable, rates for n GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from elixir_runtime.search import HardwareProfile, load_hardware
from elixir_runtime.search.hardware import ENV_HARDWARE, cache_path
import elixir_runtime.search.measure as measure
from elixir_runtime.search.measure import measure_hardware
from search_cases import gpu_host


def test_quick_cpu_measurement_is_a_valid_profile() -> None:
    measure._kernel(torch.device("cpu"))  # a first use builds the C++ kernel: not part of the measurement
    start = time.perf_counter()
    hw = measure_hardware(quick=True)
    assert time.perf_counter() - start < 15
    assert hw.cpu_only and hw.gpus == 1 and hw.gpu_memory == hw.host_memory > 0
    assert all(v > 0 for v in (hw.attention, hw.memory_bandwidth, hw.op_overhead, hw.gpu_adam, hw.cpu_adam))
    assert hw.matmul and all(v > 0 for v in hw.matmul.values())
    assert hw.links[1].c2g > 0 and hw.links[1].g2c > 0
    assert "measured on" in hw.source


def test_json_round_trip_and_file_override(tmp_path, monkeypatch) -> None:
    hw = gpu_host(gpus=2)
    path = tmp_path / "hw.json"
    hw.save(path)
    assert HardwareProfile.load(path) == hw
    monkeypatch.setenv(ENV_HARDWARE, str(path))
    assert load_hardware().device == "test GPU"
    assert load_hardware(path).links[2].g2g == 200e9


def test_measured_once_then_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(measure, "measure_hardware", lambda quick=False: calls.append(1) or gpu_host())
    first = load_hardware()
    assert cache_path().parent == tmp_path and cache_path().exists()
    assert load_hardware() == first and len(calls) == 1


def test_rates_share_the_host_and_scale_beyond_what_was_measured() -> None:
    hw = gpu_host(gpus=2, cpu_adam=6e9)
    one, two = hw.rates(1), hw.rates(2)
    assert one.h2d == pytest.approx(50e9) and two.h2d == pytest.approx(50e9)  # one link per GPU
    assert two.cpu_adam == pytest.approx(3e9)  # the ranks share the host's cores
    assert one.busbw is None and two.busbw == 200e9 and not two.notes
    four = hw.rates(4)
    assert four.h2d == pytest.approx(50e9) and four.busbw is None
    assert any("scaled" in n for n in four.notes) and any("collective" in n for n in four.notes)
    assert one.flop_rate("3000") == 600e12 and one.flop_rate("300") == 50e12 and one.flop_rate("attention") == 300e12
