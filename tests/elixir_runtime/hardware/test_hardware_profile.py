"""Hardware profile: measured on this (CPU) machine, cached, overridable, rates for n GPUs."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

import elixir_runtime.hardware.measure as measure
from elixir_runtime.adam_state import ADAM_STATE
from elixir_runtime.distributed.collectives import Collectives
from elixir_runtime.hardware import HardwareProfile, load_hardware
from elixir_runtime.hardware.load import ENV_HARDWARE, cache_path, record_update_rate, with_step_gemms
from elixir_runtime.hardware.measure import measure_hardware
from elixir_runtime.hardware.profile import ELEMENTWISE_OF_COPY, PROFILE_VERSION, CpuAdamRate
from elixir_runtime.kernels.cpu_adam import load_library
from elixir_runtime.kernels.threads import cpu_adam_threads
from helpers.dist import run_distributed
from helpers.logs import recorded_bars
from tests.elixir_runtime.hardware.job_ranks import job_measures_cpu_adam, job_records_update_rate
from tests.elixir_runtime.search.search_cases import gpu_host

FP32 = ADAM_STATE["fp32"]
VERSION_2 = {**gpu_host().to_dict(), "version": 2, "cpu_adam": 3.2e9, "cpu_adam_alone": 5.6e9}
"""A profile as version 2 wrote it: one CPU Adam rate for the host."""


@pytest.mark.perf
def test_quick_measurement_is_quick() -> None:
    load_library()
    start = time.perf_counter()
    measure_hardware(quick=True, ranks=(1,))
    assert time.perf_counter() - start < (60 if torch.cuda.is_available() else 15)


def test_quick_measurement_is_a_valid_profile() -> None:
    """Of this machine: the host as the "device" on CI, the GPUs where there are some."""
    load_library()  # a first use builds the C++ kernel: not part of the measurement
    with recorded_bars() as bars:
        hw = measure_hardware(quick=True, ranks=(1,))
    assert [(b.desc, b.total, b.n, b.closed) for b in bars] == [("elixir: measuring this machine", 2, 2, True)]
    if torch.cuda.is_available():
        assert not hw.cpu_only and hw.gpus == torch.cuda.device_count() and hw.links[hw.gpus].duplex > 0
    else:
        assert hw.cpu_only and hw.gpus == 1 and hw.gpu_memory == hw.host_memory > 0
    assert hw.version == PROFILE_VERSION
    assert all(
        v > 0
        for v in (*hw.attention.values(), hw.memory_bandwidth, hw.op_overhead, hw.gpu_adam, hw.cpu_adam[1].under_copies)
    )
    assert hw.elementwise is not None and hw.elementwise > 0
    assert list(hw.cpu_adam) == [1] and hw.cpu_adam[1].threads == cpu_adam_threads(1)
    assert list(hw.attention) == ["128", "256"]  # by sequence length
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


@pytest.fixture()
def measured(tmp_path, monkeypatch) -> list[str]:
    """This machine's profile cached in ``tmp_path``, as on a one-GPU host, with both measurements stubbed
    (``gpu_host(cpu_adam=6e9)``; the 8-bit CPU Adam it lacks at 3e9): the names of those ``load_hardware`` ran."""
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    fresh = dataclasses.replace(gpu_host(cpu_adam=6e9), version=PROFILE_VERSION)

    def hardware(quick: bool = False, ranks=None) -> HardwareProfile:
        calls.append("hardware")
        return dataclasses.replace(fresh, cpu_adam8={})

    def cpu_adam(n: int, *, quick: bool = False, state=FP32, **_) -> CpuAdamRate:
        calls.append(f"cpu_adam[{n}] {state.moments}")
        return CpuAdamRate(n, 1, 3e9, 3e9)

    monkeypatch.setattr(measure, "rank_counts", lambda gpus=None: [1])
    monkeypatch.setattr(measure, "measure_hardware", hardware)
    monkeypatch.setattr(measure, "host_cpu_adam", cpu_adam)
    return calls


def test_measured_once_then_cached(measured) -> None:
    """The 8-bit CPU Adam the measured profile lacks is measured with it, and cached too."""
    first = load_hardware()
    assert cache_path().exists() and first.cpu_adam8[1].under_copies == 3e9
    assert load_hardware() == first and measured == ["hardware", "cpu_adam[1] 8bit"]


def test_a_cached_profile_of_an_older_measurement_is_measured_again(measured, tmp_path) -> None:
    """Version 6 did not time the memory-bound ops."""
    dataclasses.replace(gpu_host(cpu_adam=9e9), version=6).save(cache_path())
    assert (
        load_hardware().cpu_adam[1].under_copies == 6e9
        and HardwareProfile.load(cache_path()).version == PROFILE_VERSION
    )
    assert measured[0] == "hardware" and cache_path().parent == tmp_path


def test_a_cached_profile_of_a_version_no_longer_read_is_measured_again_with_a_warning(measured, caplog) -> None:
    """The cache is this machine's own: measured again, not refused (a file given by the user is refused)."""
    cache_path().write_text(json.dumps(VERSION_2))
    assert load_hardware().version == PROFILE_VERSION and measured[0] == "hardware"
    assert HardwareProfile.load(cache_path()).cpu_adam[1].under_copies == 6e9  # the old file replaced
    assert f"{cache_path()} is version 2" in caplog.text and "measuring this machine again" in caplog.text


def test_an_unreadable_cached_profile_is_measured_again(measured, caplog) -> None:
    cache_path().write_text('{"device": "half a write')
    assert load_hardware() == HardwareProfile.load(cache_path()) and measured[0] == "hardware"
    assert load_hardware().cpu_adam[1].under_copies == 6e9
    assert "cannot be read" in caplog.text


def test_rates_share_the_host_and_scale_beyond_what_was_measured() -> None:
    hw = gpu_host(gpus=2)
    one, two = hw.rates(1), hw.rates(2)
    assert one.h2d == pytest.approx(50e9) and two.h2d == pytest.approx(50e9)  # one link per GPU
    assert one.busbw is None and two.busbw == 200e9
    four = hw.rates(4)
    assert four.h2d == pytest.approx(50e9) and four.busbw is None
    assert any("links" in n and "scaled" in n for n in four.notes) and any("collective" in n for n in four.notes)
    measured = hw.rates(4, busbw=90e9)  # timed on the job's own group: replaces the proxy
    assert measured.busbw == 90e9 and not any("collective" in n and "not measured" in n for n in measured.notes)
    assert (
        one.flop_rate("3000") == 600e12 and one.flop_rate("300") == 50e12 and one.flop_rate("attention:512") == 300e12
    )


def test_attention_is_priced_at_the_nearest_measured_length() -> None:
    hw = dataclasses.replace(gpu_host(), attention={"1024": 300e12, "4096": 450e12})
    rates = hw.rates(1)
    assert [rates.flop_rate(f"attention:{s}") for s in (512, 1500, 3000, 32768)] == [300e12, 300e12, 450e12, 450e12]
    assert rates.flop_rate("4096") == 600e12  # a GEMM of the same size: its own table


def test_a_profile_with_one_attention_rate_prices_every_length_with_it() -> None:
    """Versions before 6 timed one seq-1024 shape: plans of old records replay as predicted."""
    old = {**gpu_host().to_dict(), "version": 5, "attention": 193e12}
    hw = HardwareProfile.from_dict(old)
    assert hw.attention == {"1024": 193e12}
    assert {hw.rates(1).flop_rate(f"attention:{s}") for s in (256, 2048, 8192)} == {193e12}
    assert HardwareProfile.from_json(hw.to_json()) == hw


def test_a_gemm_is_priced_at_its_shapes_rate_else_at_the_nearest_square() -> None:
    hw = dataclasses.replace(gpu_host(), matmul={"1024": 100e12, "4096": 600e12}, gemms={"8192x1024x4096": 450e12})
    rates = hw.rates(1)
    assert rates.flop_rate("8192x1024x4096") == 450e12  # timed
    assert rates.flop_rate("8192x4096x4096") == 600e12  # geometric mean 5161: the 4096 square
    assert rates.flop_rate("1024x1024x2048") == 100e12  # 1290: the 1024 square
    assert HardwareProfile.from_json(hw.to_json()) == hw
    older = {k: v for k, v in hw.to_dict().items() if k != "gemms"}
    assert HardwareProfile.from_dict(older).gemms == {}


def test_a_steps_gemm_shapes_are_timed_once_and_cached(tmp_path, monkeypatch) -> None:
    """Only the shapes this machine's profile lacks, in its dtype; too large a shape is left to the squares."""
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    timed: list[set[str]] = []
    real = measure.gemm_rates
    monkeypatch.setattr(measure, "gemm_rates", lambda classes, *a: timed.append(set(classes)) or real(classes, *a))
    cpu, huge = torch.device("cpu"), "100000x100000x100000"
    hw = dataclasses.replace(gpu_host(), dtype="float32")
    classes = {"64x32x16", "16x16x16", huge, "attention:128", "2048"}
    first = with_step_gemms(hw, classes, torch.float32, cpu)
    assert timed == [{"64x32x16", "16x16x16", huge}]
    assert set(first.gemms) == {"64x32x16", "16x16x16"} and all(r > 0 for r in first.gemms.values())
    assert HardwareProfile.load(cache_path()).gemms == first.gemms
    assert with_step_gemms(first, {"64x32x16", "16x16x16"}, torch.float32, cpu) is first and len(timed) == 1
    assert with_step_gemms(hw, classes, torch.bfloat16, cpu) is hw and len(timed) == 1  # another dtype's shapes


def test_memory_bound_ops_are_priced_at_their_own_rate_else_at_a_share_of_the_copys() -> None:
    """Versions before 7 measured only a copy: their plans price the ops' bytes at the share of it
    such ops reach on the same chip ([Note: memory-bound ops unmeasured])."""
    hw = dataclasses.replace(gpu_host(), elementwise=1.2e12)
    assert hw.rates(1).elementwise == 1.2e12 and hw.rates(1).memory_bandwidth == hw.memory_bandwidth
    assert HardwareProfile.from_json(hw.to_json()) == hw
    old = {k: v for k, v in gpu_host().to_dict().items() if k != "elementwise"}
    unmeasured = HardwareProfile.from_dict({**old, "version": 6}).rates(1)
    assert unmeasured.elementwise == ELEMENTWISE_OF_COPY * hw.memory_bandwidth < hw.memory_bandwidth


def test_rates_take_the_cpu_adam_measured_for_the_ranks_per_host() -> None:
    """Per rank as measured for that many ranks on the host; a count not measured shares the
    nearest measured count's host total, and says so."""
    hw = dataclasses.replace(
        gpu_host(gpus=4), cpu_adam={1: CpuAdamRate(1, 63, 6e9, 7e9), 4: CpuAdamRate(4, 15, 2.5e9, 3e9)}
    )
    one, four = hw.rates(1), hw.rates(4)
    assert (one.cpu_adam, one.cpu_adam_alone, one.cpu_threads) == (6e9, 7e9, 63)
    assert (four.cpu_adam, four.cpu_adam_alone, four.cpu_threads) == (2.5e9, 3e9, 15)
    assert not any("CPU Adam" in n for n in one.notes + four.notes)
    two = hw.rates(2)
    assert two.cpu_adam == pytest.approx(3e9) and two.cpu_threads == cpu_adam_threads(2, cores=16)
    assert any("CPU Adam for 2 ranks per host not measured: 1 ranks' rate" in n for n in two.notes)
    assert hw.rates(8).cpu_adam == pytest.approx(1.25e9)  # 4 ranks' rates shared among 8
    # 8 ranks on two hosts of 4: each rank gets what 4 ranks on one host get
    assert hw.rates(8, ranks_per_host=4).cpu_adam == 2.5e9


def test_a_profile_of_version_1_or_2_is_refused_naming_the_file_and_the_fix(tmp_path) -> None:
    """Their one CPU Adam rate (the whole host, one process) mispredicts any host of several GPUs;
    elixir-hf 0.2.0 is the last release that reads them."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(VERSION_2))
    with pytest.raises(
        ValueError, match=rf"{path} is version 2.*reads versions 3 to {PROFILE_VERSION} \(elixir-hf 0.2.0"
    ):
        HardwareProfile.load(path)
    with pytest.raises(ValueError, match="elixir-plan --measure-hardware PATH"):
        load_hardware(path)
    shipped = load_hardware("h100")  # version 3, measured on one GPU: its rate is one rank's
    assert shipped.cpu_adam[1].ranks == 1 and shipped.rates(1).cpu_adam == shipped.cpu_adam[1].under_copies > 1e9


def test_a_job_measures_cpu_adam_on_all_its_ranks_at_once_and_caches_it(tmp_path, monkeypatch) -> None:
    """2 gloo ranks on one host: each times the kernel with its own threads for 2 ranks per host,
    in the same window as the other (not rank 0 alone while the other waits: each rank's timed window
    starts right after a collective both ranks take part in, the barrier); the slowest rank's rate is
    every rank's, cached beside the machine's one-rank rate and not measured again."""
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    seeded = dataclasses.replace(gpu_host(), device="cpu", version=PROFILE_VERSION)
    seeded.save(cache_path())  # this machine's profile, measured before by a one-rank job
    results = run_distributed(job_measures_cpu_adam, 2, str(tmp_path))
    (first0, second0, events0, measured0, after0), (first1, second1, events1, measured1, after1) = results
    assert first0 == first1 == second0 == second1
    rate = first0[2]
    assert (rate.ranks, rate.threads) == (2, cpu_adam_threads(2)) and rate.under_copies > 0
    assert rate.alone == rate.under_copies  # no GPU to copy to
    assert first0[1] == seeded.cpu_adam[1]
    assert measured0 == measured1 == 1 and after0 == after1 == 1  # timed once (alone: no GPU to copy to)
    assert events0 == events1  # the same collectives on both ranks, in the same order
    timed = events0.index("window")
    assert timed > 0 and events0[timed - 1] == "all_reduce"  # the barrier, then the timed window
    assert HardwareProfile.from_json(cache_path().read_text()).cpu_adam == first0


@pytest.mark.gpu  # pinned copies to a GPU
def test_cpu_adam_is_timed_under_copies_both_ways() -> None:
    under, alone = measure.rank_cpu_adam(cpu_adam_threads(1), torch.device("cuda", 0), lambda: None, quick=True)
    assert 1e6 < under < 1e12 and 1e6 < alone < 1e12


@pytest.mark.gpu
def test_spawned_ranks_measure_the_per_rank_rate_of_two_ranks() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one spawned rank per GPU)")
    rate = measure.host_cpu_adam(2, quick=True)
    assert (rate.ranks, rate.threads) == (2, cpu_adam_threads(2)) and 1e6 < rate.under_copies <= rate.alone * 1.5


def test_adam_is_timed_on_values_like_a_runs(monkeypatch) -> None:
    """[Note: values]: not zeros, which some CPUs divide and square-root faster."""
    seen = []

    class Recorder:
        def step(self, state, grad, out, *args, **kwargs):
            seen.append((state.master.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), grad.float()))

    monkeypatch.setattr(measure, "select_kernel", lambda device, threads=None: Recorder())
    measure._adam_update(torch.device("cpu"), 4096, torch.bfloat16, 1)()
    master, m, v, grad = seen[0]
    assert 0.01 < master.std() < 0.04 and 5e-5 < m.std() < 2e-4 and 5e-4 < grad.std() < 2e-3
    assert (v > 0).float().mean() > 0.99 and (master != 0).all()


def test_a_jobs_update_rate_is_recorded_in_this_machines_profile(tmp_path, monkeypatch) -> None:
    """Where the job planned with this machine's cached profile and the entry for its ranks was
    measured with its threads; the slowest rank's rate (``job_records_update_rate``: 2e9 and 3e9)."""
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    seeded = dataclasses.replace(gpu_host(), cpu_adam={2: CpuAdamRate(2, 7, 2e9, 4e9)}, version=PROFILE_VERSION)
    seeded.save(cache_path())
    assert run_distributed(job_records_update_rate, 2, str(tmp_path)) == [2e9, 2e9]
    assert HardwareProfile.load(cache_path()).cpu_adam[2] == CpuAdamRate(2, 7, 2e9, 4e9, observed=2e9)
    one = Collectives(None)
    for kept in (
        lambda: record_update_rate(one, torch.device("cpu"), 2, 15, 5e9, FP32),  # another measurement's threads
        lambda: record_update_rate(one, torch.device("cpu"), 4, 7, 5e9, FP32),  # no entry for 4 ranks
        lambda: record_update_rate(one, torch.device("cpu"), 2, 7, 0.0, FP32),  # no rate
    ):
        kept()
        assert HardwareProfile.load(cache_path()).cpu_adam[2].observed == 2e9
    monkeypatch.setenv(ENV_HARDWARE, str(tmp_path / "given.json"))  # the job planned with a file
    record_update_rate(one, torch.device("cpu"), 2, 7, 5e9, FP32)
    assert HardwareProfile.load(cache_path()).cpu_adam[2].observed == 2e9
    monkeypatch.delenv(ENV_HARDWARE)
    assert record_update_rate(one, torch.device("cpu"), 2, 7, 5e9, FP32) == 5e9
    assert HardwareProfile.load(cache_path()).cpu_adam[2].observed == 5e9


def test_an_observed_rate_is_shared_like_the_measured_ones() -> None:
    hw = dataclasses.replace(gpu_host(gpus=4), cpu_adam={2: CpuAdamRate(2, 7, 2e9, 4e9, observed=3e9)})
    assert hw.rates(2).cpu_update_observed == 3e9
    assert hw.rates(4).cpu_update_observed == 1.5e9  # 2 ranks' rate shared among 4, as the others
    assert hw.rates(4).cpu_adam_alone == 2e9
    assert HardwareProfile.from_json(hw.to_json()) == hw


def test_an_unreadable_cached_profile_does_not_fail_the_step(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV_HARDWARE, raising=False)
    monkeypatch.setenv("ELIXIR_CACHE_DIR", str(tmp_path))
    cache_path().write_text("{ not json")
    assert record_update_rate(Collectives(None), torch.device("cpu"), 1, 15, 5e9, FP32) == 5e9
    assert "could not record" in caplog.text and cache_path().read_text() == "{ not json"


def test_8bit_rates_are_the_measured_ones_else_exacts_with_a_note() -> None:
    """No ratio carries between machines ([Note: rates of another state]): unmeasured, 8-bit moments are
    priced at the exact state's rates, said so; measured, at their own."""
    eight = ADAM_STATE["8bit"]
    hw = dataclasses.replace(gpu_host(), cpu_adam={1: CpuAdamRate(1, 7, 2e9, 4e9)}, cpu_adam8={}, gpu_adam8=None)
    unmeasured = hw.rates(1, state=eight)
    assert (unmeasured.cpu_adam, unmeasured.cpu_adam_alone, unmeasured.gpu_adam) == (2e9, 4e9, hw.gpu_adam)
    assert any("8bit moments' Adam rates not measured" in n for n in unmeasured.notes)
    hw = dataclasses.replace(hw, cpu_adam8={1: CpuAdamRate(1, 7, 3e9, 5e9)}, gpu_adam8=7e10)
    measured = hw.rates(1, state=eight)
    assert (measured.cpu_adam, measured.cpu_adam_alone, measured.gpu_adam) == (3e9, 5e9, 7e10)
    assert not any("not measured" in n for n in measured.notes) and hw.rates(1).cpu_adam == 2e9
    assert HardwareProfile.from_json(hw.to_json()) == hw
