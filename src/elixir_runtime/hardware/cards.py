"""Cards a plan can be made for without owning one: their published figures, and the one rule that
derives a card's profile from a measured one.

[Note: a derived profile] Where a card cannot be reached to measure it, its profile is the measured
profile of a card like it (``REFERENCE``: the shipped H100's), each rate scaled by the ratio of the
two cards' published figures for what bounds it:

- matmul (every size) and attention: dense bf16 tensor-core peak (no sparsity);
- device memory bandwidth and the GPU Adam (memory-bound): HBM/GDDR bandwidth;
- host links (pinned copies up, down, both at once): PCIe x16 bandwidth, 2x per generation,
  so a Gen4 card gets half the H100 host's measured Gen5 copies;
- the collective link between GPUs, where the base measured one: NVLink bandwidth, or PCIe for a
  card without NVLink;
- GPU memory: the card's total as ``nvidia-smi`` lists it, less what the base's driver kept from
  CUDA (the base card's ``nvidia-smi`` total minus its measured ``gpu_memory``);
- the per-op dispatch cost: kept (the host's, not the card's).

The host side (RAM, cores, CPU Adam rates) stays the base profile's machine's: a derived card
is planned in the H100 box (126 GiB, 16 cores) unless ``elixir-plan --host-mem`` says otherwise.
Small GEMMs are launch-bound on any card, so scaling them by the peak understates a slower card's;
they weigh little in a model's step. How close a derived profile comes to a measured one:
docs/planning.md, "Profiles for other cards".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .profile import HardwareProfile, LinkRates

__all__ = ["Card", "CARDS", "REFERENCE", "derive"]

MIB = 2**20


@dataclass(frozen=True)
class Card:
    """A card's published figures (``source``: where they are published)."""

    name: str
    """The name ``elixir-plan --gpu`` takes."""
    device: str
    """What ``torch.cuda.get_device_name`` says."""
    memory_mib: int
    """Total memory as ``nvidia-smi`` lists it."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak with fp32 accumulation, without sparsity."""
    memory_tbps: float
    """HBM/GDDR bandwidth, TB/s."""
    pcie_gen: int
    """The host link: PCIe of this generation, x16."""
    gpu_link_gbps: float
    """Between GPUs, GB/s both ways: NVLink; without it, the PCIe x16 link."""
    gpu_link: str
    source: str


CARDS: dict[str, Card] = {
    card.name: card
    for card in (
        Card(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            40960,
            312,
            1.555,
            4,
            600,
            "NVLink 3",
            "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM)",
        ),
        Card(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            81920,
            312,
            2.039,
            4,
            600,
            "NVLink 3",
            "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)",
        ),
        Card(
            "h100",
            "NVIDIA H100 80GB HBM3",
            81559,
            989,
            3.35,
            5,
            900,
            "NVLink 4",
            "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM); nvidia-smi on the measured host",
        ),
        Card(
            "h200",
            "NVIDIA H200",
            143771,
            989,
            4.8,
            5,
            900,
            "NVLink 4",
            "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM); nvidia-smi on a 2 x H200 host",
        ),
        Card(
            "l40s",
            "NVIDIA L40S",
            46068,
            362.05,
            0.864,
            4,
            64,
            "PCIe Gen4, no NVLink",
            "NVIDIA L40S datasheet (48 GB GDDR6 with ECC on)",
        ),
        Card(
            "rtx4090",
            "NVIDIA GeForce RTX 4090",
            24564,
            165.2,
            1.008,
            4,
            64,
            "PCIe Gen4, no NVLink, no peer-to-peer",
            "NVIDIA Ada GPU Architecture whitepaper, appendix (GeForce RTX 4090: bf16 with fp32 accumulate)",
        ),
    )
}
"""Every card ``elixir-plan --gpu`` knows, by name (docs/planning.md, "Profiles for other cards")."""

REFERENCE = "h100"
"""The card whose measured profile the others are derived from (``load.MEASURED``)."""


def derive(base: HardwareProfile, card: Card, base_card: Card | None = None) -> HardwareProfile:
    """``card``'s profile from ``base``, measured on ``base_card`` (default: ``REFERENCE``), by
    [Note: a derived profile]; ``source`` says so, with the ratios. ``base``: bf16 rates."""
    ref = base_card or CARDS[REFERENCE]
    if base.dtype != "bfloat16":
        raise ValueError(f"a profile is derived from bf16 rates; {base.source!r} has {base.dtype} rates")
    compute = card.bf16_tflops / ref.bf16_tflops
    memory = card.memory_tbps / ref.memory_tbps
    host = 2.0 ** (card.pcie_gen - ref.pcie_gen)
    peer = card.gpu_link_gbps / ref.gpu_link_gbps

    def link(rates: LinkRates) -> LinkRates:
        return LinkRates(
            rates.n,
            rates.c2g * host,
            rates.g2c * host,
            rates.duplex * host if rates.duplex else None,
            rates.g2g * peer if rates.g2g else None,
        )

    reserved = ref.memory_mib * MIB - base.gpu_memory
    return dataclasses.replace(
        base,
        device=card.device,
        gpu_memory=card.memory_mib * MIB - reserved,
        matmul={size: rate * compute for size, rate in base.matmul.items()},
        gemms={shape: rate * compute for shape, rate in base.gemms.items()},
        attention={seq: rate * compute for seq, rate in base.attention.items()},
        memory_bandwidth=base.memory_bandwidth * memory,
        elementwise=base.elementwise * memory if base.elementwise else None,
        gpu_adam=base.gpu_adam * memory,
        links={n: link(rates) for n, rates in base.links.items()},
        cpu_adam={n: dataclasses.replace(rate) for n, rate in base.cpu_adam.items()},
        source=(
            f"derived from the {ref.name} profile ({base.source}) by published figures ({card.source}): "
            f"compute x{compute:.3f} ({card.bf16_tflops:g}/{ref.bf16_tflops:g} bf16 TFLOPS), memory x{memory:.3f} "
            f"({card.memory_tbps:g}/{ref.memory_tbps:g} TB/s), host link x{host:g} (PCIe Gen{card.pcie_gen}/"
            f"Gen{ref.pcie_gen}), GPU link x{peer:.3f} ({card.gpu_link}/{ref.gpu_link}); "
            f"host RAM, cores and CPU Adam: the {ref.name} profile's host's"
        ),
    )
