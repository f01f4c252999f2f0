"""Shipped cards: each loads, says whether it was measured or derived and from what, and a derived
profile is the H100's scaled by the ratios of the published figures ([Note: a derived profile])."""

from __future__ import annotations

import dataclasses

import pytest

from elixir_runtime.hardware import load_hardware
from elixir_runtime.hardware.cards import CARDS, REFERENCE, derive
from elixir_runtime.hardware.load import MEASURED, SHIPPED, shipped_hardware
from elixir_runtime.hardware.profile import LinkRates

MIB = 2**20


def test_every_shipped_card_loads_labelled_measured_or_derived() -> None:
    assert set(SHIPPED) == {"a100-40gb", "a100-80gb", "h100", "h200", "l40s", "rtx4090"} and set(MEASURED) == {"h100"}
    for name in SHIPPED:
        hw = load_hardware(name.upper())  # names are case-blind
        card = CARDS[name]
        assert hw.device == card.device and not hw.cpu_only and hw.rates(1).h2d > 0
        assert hw.source.startswith(f"shipped profile {name!r}, ")
        if name in MEASURED:
            assert "measured on" in hw.source and "derived" not in hw.source
        else:
            assert f"derived from the {REFERENCE} profile (measured on" in hw.source
            assert card.source in hw.source and "host RAM, cores and CPU Adam: the h100 profile's host's" in hw.source


def test_a_derived_card_scales_the_h100_by_its_published_figures() -> None:
    h100, a100 = shipped_hardware("h100"), shipped_hardware("a100-80gb")
    compute, memory = 312 / 989, 2.039 / 3.35
    assert a100.matmul.keys() == h100.matmul.keys()
    assert all(a100.matmul[s] == pytest.approx(h100.matmul[s] * compute) for s in h100.matmul)
    assert a100.attention == pytest.approx({s: r * compute for s, r in h100.attention.items()})
    assert a100.memory_bandwidth == pytest.approx(h100.memory_bandwidth * memory)
    assert a100.gpu_adam == pytest.approx(h100.gpu_adam * memory)
    link, ref = a100.links[1], h100.links[1]  # PCIe Gen4 against the H100 host's Gen5: half
    assert (link.c2g, link.g2c, link.duplex) == pytest.approx((ref.c2g / 2, ref.g2c / 2, ref.duplex / 2))
    # the card's nvidia-smi total less what the H100's driver kept from CUDA (81559 MiB listed, 81079 seen)
    assert h100.gpu_memory == 81079 * MIB and a100.gpu_memory == (81920 - 480) * MIB
    # the host side is the H100 box's
    assert (a100.op_overhead, a100.host_memory, a100.cpu_cores) == (h100.op_overhead, h100.host_memory, h100.cpu_cores)
    assert a100.cpu_adam == h100.cpu_adam and a100.cpu_adam[1] is not h100.cpu_adam[1]
    assert "compute x0.315 (312/989 bf16 TFLOPS), memory x0.609 (2.039/3.35 TB/s), host link x0.5" in a100.source


def test_a_measured_elementwise_rate_scales_with_the_bandwidth() -> None:
    h100 = dataclasses.replace(shipped_hardware("h100"), elementwise=2e12)
    a100 = derive(h100, CARDS["a100-80gb"])
    assert a100.elementwise == pytest.approx(2e12 * 2.039 / 3.35)
    assert derive(shipped_hardware("h100"), CARDS["a100-80gb"]).elementwise is None  # the copy's, as measured


def test_the_h200_is_the_h100s_compute_with_its_bandwidth() -> None:
    h100, h200 = shipped_hardware("h100"), shipped_hardware("h200")
    assert h200.matmul == pytest.approx(h100.matmul) and h200.attention == pytest.approx(h100.attention)
    assert h200.memory_bandwidth == pytest.approx(h100.memory_bandwidth * 4.8 / 3.35)
    assert h200.links[1] == h100.links[1] and h200.gpu_memory == (143771 - 480) * MIB


def test_a_measured_collective_link_scales_by_the_gpu_link() -> None:
    """NVLink 4 to PCIe Gen4 for a card without NVLink; none measured stays none."""
    base = dataclasses.replace(
        shipped_hardware("h100"), links={1: LinkRates(1, 50e9, 50e9), 2: LinkRates(2, 100e9, 100e9, None, 450e9)}
    )
    l40s = derive(base, CARDS["l40s"])
    assert l40s.links[2].g2g == pytest.approx(450e9 * 64 / 900) and l40s.links[1].g2g is None
    assert l40s.links[2].duplex is None and l40s.links[2].c2g == pytest.approx(50e9)


def test_only_bf16_rates_are_derived() -> None:
    fp32 = dataclasses.replace(shipped_hardware("h100"), dtype="float32")
    with pytest.raises(ValueError, match="float32 rates"):
        derive(fp32, CARDS["l40s"])


def test_an_unknown_card_names_the_cards_and_the_fix() -> None:
    with pytest.raises(ValueError) as exc:
        shipped_hardware("a200")
    with pytest.raises(FileNotFoundError) as missing:
        load_hardware("a200")
    for message in (str(exc.value), str(missing.value)):
        assert "'a200' is no card elixir-plan knows" in message and ", ".join(SHIPPED) in message
        assert "`elixir-plan --measure-hardware hw.json`" in message and "`--hardware hw.json`" in message
    assert "and no profile file" in str(missing.value)
