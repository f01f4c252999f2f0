"""Hardware profile: measured on this (CPU) machine, cached, overridable, rates for n GPUs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from elixir_runtime.hardware import HardwareProfile, load_hardware
from elixir_runtime.hardware.load import ENV_HARDWARE, cache_path
from elixir_runtime.hardware.profile import PROFILE_VERSION, LinkRates
import elixir_runtime.hardware.measure as measure
from elixir_runtime.hardware.measure import measure_hardware
from tests.elixir_runtime.search.search_cases import gpu_host


def test_quick_measurement_is_a_valid_profile() -> None:
    """Of this machine: the host as the "device" on CI, the GPUs where there are some."""
    measure._kernel(torch.device("cpu"))  # a first use builds the C++ kernel: not part of the measurement
    start = time.perf_counter()
    hw = measure_hardware(quick=True)
    assert time.perf_counter() - start < (60 if torch.cuda.is_available() else 15)
    if torch.cuda.is_available():
        assert not hw.cpu_only and hw.gpus == torch.cuda.device_count() and hw.links[hw.gpus].duplex > 0
    else:
        assert hw.cpu_only and hw.gpus == 1 and hw.gpu_memory == hw.host_memory > 0
    assert hw.version == PROFILE_VERSION
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
    current = dataclasses.replace(gpu_host(), version=PROFILE_VERSION)
    monkeypatch.setattr(measure, "measure_hardware", lambda quick=False: calls.append(1) or current)
    first = load_hardware()
    assert cache_path().parent == tmp_path and cache_path().exists()
    assert load_hardware() == first and len(calls) == 1


def test_a_cached_profile_of_an_older_measurement_is_measured_again(tmp_path, monkeypatch) -> None:
    """Version 1 timed the CPU Adam alone with every core: too fast for what the engine gets."""
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    dataclasses.replace(gpu_host(cpu_adam=9e9), version=1).save(cache_path())
    fresh = dataclasses.replace(gpu_host(cpu_adam=6e9), version=PROFILE_VERSION)
    monkeypatch.setattr(measure, "measure_hardware", lambda quick=False: fresh)
    assert load_hardware().cpu_adam == 6e9 and HardwareProfile.load(cache_path()).version == PROFILE_VERSION


def test_rates_share_the_host_and_scale_beyond_what_was_measured() -> None:
    hw = gpu_host(gpus=2, cpu_adam=6e9)
    one, two = hw.rates(1), hw.rates(2)
    assert one.h2d == pytest.approx(50e9) and two.h2d == pytest.approx(50e9)  # one link per GPU
    assert two.cpu_adam == pytest.approx(3e9)  # the ranks share the host's cores
    assert one.busbw is None and two.busbw == 200e9 and not two.notes
    four = hw.rates(4)
    assert four.h2d == pytest.approx(50e9) and four.busbw is None
    assert any("scaled" in n for n in four.notes) and any("collective" in n for n in four.notes)
    measured = hw.rates(4, busbw=90e9)  # timed on the job's own group: replaces the proxy
    assert measured.busbw == 90e9 and not any("collective" in n and "not measured" in n for n in measured.notes)
    assert one.flop_rate("3000") == 600e12 and one.flop_rate("300") == 50e12 and one.flop_rate("attention") == 300e12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned copies to a GPU)")
def test_cpu_adam_is_timed_under_copies_both_ways() -> None:
    link = LinkRates(1, 50e9, 50e9, 40e9)
    rate = measure._cpu_adam_under_copies(link, 2**21, torch.bfloat16, 64 * 2**20)
    assert 1e6 < rate < 1e12
