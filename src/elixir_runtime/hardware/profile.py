"""The machine's speeds and sizes the cost model needs, measured once and cached as JSON.

Everything here is measured (``measure.py``), never fitted or typed in: pinned-copy bandwidths
B_c2g(n), B_g2c(n) for n GPUs copying at once, Adam update velocities V_g, V_c of this project's
kernels, matmul rates per GEMM size class, attention and memory-stream rates, the per-op
dispatch cost, GPU memory and host RAM. A profile is cached per machine under
``~/.cache/elixir/`` (``$ELIXIR_CACHE_DIR``) and can be replaced by a file (``--hardware``,
``$ELIXIR_HARDWARE``), e.g. one measured on the GPU machine a plan is made for.

[Note: more GPUs than measured] A plan for n GPUs on a machine measured with fewer takes each
GPU's own link as measured (every GPU has its own PCIe link), keeps the host's CPU Adam rate
(the ranks share the cores), and has no collective bandwidth (reported as not measured).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["LinkRates", "HardwareProfile", "Rates", "PROFILE_VERSION"]

PROFILE_VERSION = 2
"""2: the CPU Adam measured under pinned copies with the engine's threads (1: alone, all cores)."""


@dataclass
class LinkRates:
    """Aggregate rates of ``n`` GPUs working at once (bytes/s)."""

    n: int
    c2g: float
    """Pinned host → GPU, all ``n`` copying at once."""
    g2c: float
    duplex: float | None = None
    """Each direction while both run at once (backward uploads and offloads together)."""
    g2g: float | None = None
    """Collective bus bandwidth between the ``n`` GPUs (``None`` for one GPU or unmeasured)."""


@dataclass
class HardwareProfile:
    device: str
    gpus: int
    gpu_memory: int
    """Bytes per GPU (for a CPU-only profile: the host's RAM, the "device" being the host)."""
    host_memory: int
    cpu_cores: int
    matmul: dict[str, float]
    """FLOP/s of square GEMMs in the compute dtype, by size (``"1024"``: 1024³)."""
    attention: float
    """FLOP/s of fused causal attention, forward + backward."""
    memory_bandwidth: float
    """Device memory, bytes/s read + written by a large copy."""
    op_overhead: float
    """Seconds per op of eager dispatch and launch (the floor for tiny ops)."""
    gpu_adam: float
    """Parameters/s of the GPU Adam kernel on one GPU."""
    cpu_adam: float
    """Parameters/s of the CPU Adam kernel on the whole host with the engine's threads; on a GPU
    host while pinned copies run both ways on every GPU's link, as they do whenever the engine's
    CPU updates run (the copies take host memory bandwidth the update needs)."""
    links: dict[int, LinkRates] = field(default_factory=dict)
    cpu_adam_alone: float | None = None
    """``cpu_adam`` with no copies running: an upper bound, kept to check how much the copies of a
    real step (a small share of it) slow the update (``None``: not measured)."""
    dtype: str = "bfloat16"
    source: str = ""
    torch: str = ""
    version: int = 0
    """``PROFILE_VERSION`` of the measurement; a cached profile of an older one is measured again."""

    @property
    def cpu_only(self) -> bool:
        return self.device == "cpu"

    def to_dict(self) -> dict:
        """JSON-native (``links`` keyed by strings), so a plan holding it survives a JSON round trip."""
        d = asdict(self)
        d["links"] = {str(n): link for n, link in d["links"].items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        d = dict(d)
        d["links"] = {int(k): LinkRates(**v) for k, v in d.get("links", {}).items()}
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        profile = cls.from_json(Path(path).read_text())
        profile.source = profile.source or str(path)
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp{os.getpid()}")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    def rates(self, n: int, busbw: float | None = None) -> "Rates":
        """Per-rank rates for ``n`` ranks on this machine (see [Note: more GPUs than measured]);
        ``busbw``: the collective bus bandwidth measured on the job's own process group, which
        replaces the profile's peer-copy proxy."""
        notes: list[str] = []
        if n in self.links:
            link = self.links[n]
        else:
            m = max((k for k in self.links if k <= n), default=min(self.links))
            base = self.links[m]
            link = LinkRates(n, base.c2g / m * n, base.g2c / m * n, base.duplex / m * n if base.duplex else None, None)
            notes.append(f"links for {n} GPUs scaled from {m} measured (one PCIe link per GPU)")
        if n > 1 and busbw is not None:
            notes.append(f"collectives at {busbw / 1e9:.0f} GB/s bus bandwidth, measured on the job's process group")
        busbw = (busbw or link.g2g) if n > 1 else None
        if n > 1 and busbw is None:
            notes.append(f"collective bandwidth for {n} GPUs not measured: collectives assumed hidden")
        return Rates(
            n=n,
            h2d=link.c2g / n,
            d2h=link.g2c / n,
            duplex=(link.duplex / n) if link.duplex else None,
            busbw=busbw,
            gpu_adam=self.gpu_adam,
            cpu_adam=self.cpu_adam / n,
            cpu_adam_alone=self.cpu_adam_alone / n if self.cpu_adam_alone else None,
            matmul={int(k): v for k, v in self.matmul.items()},
            attention=self.attention,
            memory_bandwidth=self.memory_bandwidth,
            op_overhead=self.op_overhead,
            notes=notes,
        )


@dataclass
class Rates:
    """What one of ``n`` ranks gets: its share of the host's links and CPU, its GPU's own rates."""

    n: int
    h2d: float
    d2h: float
    duplex: float | None
    busbw: float | None
    gpu_adam: float
    cpu_adam: float
    matmul: dict[int, float]
    attention: float
    memory_bandwidth: float
    op_overhead: float
    cpu_adam_alone: float | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | None]:
        """The per-rank transfer, collective and update rates a plan was made with (GB/s, G params/s)."""
        def giga(x: float | None) -> float | None:
            return round(x / 1e9, 3) if x else None

        return {
            "ranks": self.n, "h2d_GBps": giga(self.h2d), "d2h_GBps": giga(self.d2h), "duplex_GBps": giga(self.duplex),
            "busbw_GBps": giga(self.busbw), "gpu_adam_Gps": giga(self.gpu_adam), "cpu_adam_Gps": giga(self.cpu_adam),
            "cpu_adam_alone_Gps": giga(self.cpu_adam_alone),
        }

    def flop_rate(self, size_class: str) -> float:
        """The measured rate of the nearest measured GEMM size; attention and convolutions use
        their own/the largest measured rate."""
        if size_class == "attention":
            return self.attention
        if not size_class.isdigit():
            return max(self.matmul.values())
        size = int(size_class)
        nearest = min(self.matmul, key=lambda s: abs(math.log2(s) - math.log2(size)))
        return self.matmul[nearest]
