"""The machine's speeds and sizes the cost model needs, measured once and cached as JSON.

Everything here is measured (``measure.py``), never fitted or typed in: pinned-copy bandwidths
for n GPUs copying at once, the Adam rates of this project's kernels, matmul rates per GEMM size
class, attention and memory-stream rates, the per-op dispatch cost, GPU memory and host RAM.
Where a profile comes from: ``load.py``.

[Note: more GPUs than measured] A plan for n GPUs on a machine measured with fewer takes each
GPU's own link as measured (every GPU has its own PCIe link), and has no collective bandwidth
(reported as not measured). CPU Adam is measured per rank for each number of ranks sharing the
host (``cpu_adam``); for a number not measured, the nearest measured count's host total is shared
among the ranks (noted)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..adam_state import ADAM_STATE, AdamState
from ..kernels.threads import cpu_adam_threads

__all__ = [
    "LinkRates",
    "CpuAdamRate",
    "HardwareProfile",
    "Rates",
    "PROFILE_VERSION",
    "OLDEST_VERSION",
    "ELEMENTWISE_OF_COPY",
    "UNREADABLE",
    "ATTENTION",
    "attention_keys",
    "gemm_class",
    "gemm_shape",
]

ATTENTION = "attention"
"""Fused attention's size class: ``"attention:2048"`` attends over 2048 keys (``Rates.flop_rate``)."""


def attention_keys(size_class: str) -> int | None:
    """The keys of a fused attention's size class (``"attention:2048"``: 2048); ``None`` for any other."""
    kind, _, keys = size_class.rpartition(":")
    return int(keys) if kind == ATTENTION else None


def gemm_class(m: int, n: int, k: int) -> str:
    """A GEMM's size class: its shape, ``"8192x1024x4096"`` (m x n x k)."""
    return f"{m}x{n}x{k}"


def gemm_shape(size_class: str) -> tuple[int, int, int] | None:
    """The (m, n, k) of a GEMM's size class; ``None`` for any other."""
    parts = size_class.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    m, n, k = map(int, parts)
    return m, n, k


ELEMENTWISE_OF_COPY = 0.73
"""The memory-bound ops' rate as a share of the copy's, for profiles that did not measure it.

[Note: memory-bound ops unmeasured] Profiles before version 7 timed only a 1 GiB copy, and their
plans priced the step's eager memory-bound ops at it, which every version-7 measurement showed too
fast: those ops move their bytes at about this share of a copy's bandwidth on sm_90 (an H200's
``elementwise`` over its ``memory_bandwidth``; docs/planning.md, "The compute split"). Once the
attention FLOPs were no longer counted twice, that error was no longer hidden. A profile that
lacks the rate is priced at this share of its own copy, the H100's included (the same chip)."""

UNREADABLE = (OSError, ValueError, TypeError, KeyError, AttributeError)
"""What reading a file that holds no profile raises (``HardwareProfile.load``, ``from_json``)."""

PROFILE_VERSION = 7
"""7: the memory-bound ops' own rate (``elementwise``, ``measure._elementwise_rate``, [Note: memory-bound ops]).
6: fused attention by sequence length, fresh gradients each call (``measure._attention_rates``,
[Note: attention's shapes]). 5: the CPU Adam measured with the prefetching kernel ([Note: prefetch] in ``cpu_adam.cpp``; its
gain: docs/kernels.md). 4: the Adam rates measured on values like a run's, not zeros (``measure._adam_update``, [Note:
values]: zeros were faster on some CPUs). 3: CPU Adam per rank, for each number of ranks sharing
the host, every rank updating (and copying to its GPU) at once with the engine's threads per rank.
2: one process with every core but one, under every GPU's copies, divided among the ranks (too
slow: docs/planning.md, "Why per rank"). 1: alone, all cores. Files of version 1 and 2 (one CPU Adam
rate) are refused, naming elixir-hf 0.2.0 as the last release that reads them (``from_dict``); this
machine's cached one is measured again (``load.load_hardware``)."""

OLDEST_VERSION = 3
"""The oldest version this release reads: the first with per-rank CPU Adam rates (``cpu_adam`` by ranks)."""


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
class CpuAdamRate:
    """Parameters/s of the CPU Adam kernel of ONE rank while ``ranks`` ranks of the host run it at
    once, each with ``threads`` OpenMP threads (``kernels.threads.cpu_adam_threads``) on arenas it
    allocated itself, as the engine's ranks do (``measure.rank_cpu_adam``); the slowest rank's."""

    ranks: int
    threads: int
    under_copies: float
    """While every rank's GPU copies pinned buffers up and down (the copies take host memory
    bandwidth the update needs): the rate of updates during backward or beside the device lane.
    On a host without GPU: the rate alone."""
    alone: float | None = None
    """With no copies running: the rate of updates after a synced backward without the device
    lane (``None``: not measured)."""
    observed: float | None = None
    """The rate a job's own updates of offloaded chunks ran at on this machine, after a synced
    backward without the device lane: the slowest rank's median step (``runtime/update_rate.py``),
    recorded by that job into the cached profile. The step model prices those updates at it, in
    place of ``ARENA_RATE`` x ``alone`` ([Note: the arenas' rate]); ``None``: no job recorded one."""


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
    attention: dict[str, float]
    """FLOP/s of fused causal attention, forward + backward, by sequence length (``"2048"``)."""
    memory_bandwidth: float
    """Device memory, bytes/s read + written by a large copy."""
    op_overhead: float
    """Seconds per op of eager dispatch and launch (the floor for tiny ops)."""
    gpu_adam: float
    """Parameters/s of the GPU Adam kernel on one GPU."""
    cpu_adam: dict[int, CpuAdamRate] = field(default_factory=dict)
    """Per-rank CPU Adam rates by the number of ranks sharing the host (measured for 1, 2, 4, ...
    GPUs by ``elixir-plan --measure-hardware``; a job whose count is missing from this machine's
    cached profile measures it with its own ranks at ``prepare`` and caches it)."""
    links: dict[int, LinkRates] = field(default_factory=dict)
    gemms: dict[str, float] = field(default_factory=dict)
    """FLOP/s of the GEMM shapes jobs on this machine ran (``"8192x1024x4096"``), each timed on its GPU
    when a job first planned with it ([Note: GEMMs by shape]); other shapes: ``matmul``."""
    gpu_adam8: float | None = None
    """Parameters/s of the GPU Adam on 8-bit moments (``moments="8bit"``); ``None``: not measured,
    priced from ``gpu_adam`` by the bytes each moves (``Rates.notes`` says so)."""
    cpu_adam8: dict[int, CpuAdamRate] = field(default_factory=dict)
    """Per-rank CPU Adam rates on 8-bit moments, as ``cpu_adam``; a count missing: ``cpu_adam``'s
    priced by the bytes each moves, with a note ([Note: rates of another state])."""
    elementwise: float | None = None
    """Device memory, bytes/s of eager memory-bound ops (norms, rotary, activations, adds, casts;
    forward and backward), bytes counted as the profiler counts them (each op's inputs and outputs);
    ``None`` (profiles before version 7): ``ELEMENTWISE_OF_COPY`` of ``memory_bandwidth``."""
    dtype: str = "bfloat16"
    source: str = ""
    torch: str = ""
    version: int = 0
    """``PROFILE_VERSION`` of the measurement; a cached profile of an older one is measured again."""

    @property
    def cpu_only(self) -> bool:
        return self.device == "cpu"

    def to_dict(self) -> dict[str, object]:
        """JSON-native (``links`` and ``cpu_adam`` keyed by strings), so a plan holding it survives a
        JSON round trip."""
        d = asdict(self)
        d["links"] = {str(n): link for n, link in d["links"].items()}
        d["cpu_adam"] = {str(n): rate for n, rate in d["cpu_adam"].items()}
        d["cpu_adam8"] = {str(n): rate for n, rate in d["cpu_adam8"].items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> HardwareProfile:
        """Reads versions ``OLDEST_VERSION`` to ``PROFILE_VERSION``; those before 6, whose one
        ``attention`` rate (a seq-1024 shape) serves every length, so that plans and replays of the
        recorded runs (``docs/benchmarks/results.json``) and the shipped ``h100.json`` predict what they
        did. Versions 1 and 2 (a single ``cpu_adam`` rate) raise ``ValueError`` naming ``source`` (the
        file), the version and the fix."""
        if not isinstance(d, dict):
            raise ValueError(f"hardware profile {source or '(no file)'} is not a JSON object: {type(d).__name__}")
        d = dict(d)
        if isinstance(d.get("cpu_adam"), (int, float)):
            raise ValueError(
                f"hardware profile {source or '(no file)'} is version {d.get('version', 1)}, measured before "
                f"per-rank CPU Adam rates; this elixir-hf reads versions {OLDEST_VERSION} to {PROFILE_VERSION} "
                "(elixir-hf 0.2.0 reads it): measure it again on that machine with "
                "`elixir-plan --measure-hardware PATH`"
            )
        if isinstance(d.get("attention"), (int, float)):
            d["attention"] = {"1024": d["attention"]}
        try:
            d["links"] = {int(k): LinkRates(**v) for k, v in d.get("links", {}).items()}
            for key in ("cpu_adam", "cpu_adam8"):
                d[key] = {
                    int(k): v if isinstance(v, CpuAdamRate) else CpuAdamRate(**v) for k, v in d.get(key, {}).items()
                }
            return cls(**d)
        except (TypeError, AttributeError) as exc:  # a field missing, unknown or of another shape
            raise ValueError(
                f"hardware profile {source or '(no file)'} is not one ({exc}): measure it with "
                "`elixir-plan --measure-hardware PATH`"
            ) from None

    @classmethod
    def from_json(cls, text: str, source: str = "") -> HardwareProfile:
        return cls.from_dict(json.loads(text), source)

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        """The profile in file ``path``; its ``source`` is the path where the file names none."""
        profile = cls.from_json(Path(path).read_text(), str(path))
        profile.source = profile.source or str(path)
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp{os.getpid()}")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    def on_host(self, ranks: int, cores: int) -> HardwareProfile:
        """This profile on a host of ``cores`` cores shared by ``ranks`` ranks: each state's per-rank CPU
        Adam rate is the profile's at the same cores per rank (its rate for ``ranks x its cores / cores``
        ranks, at least one: a rank is not priced above what one rank ran at on the profile's host)."""
        same = max(1, round(ranks * self.cpu_cores / cores))

        def table(state: AdamState) -> dict[int, CpuAdamRate]:
            if not self.cpu_table(state):
                return {}  # not measured: rates() prices it from the exact state's
            rate = self.cpu_adam_per_rank(same, [], state)
            return {ranks: replace(rate, ranks=ranks, threads=cpu_adam_threads(ranks, cores=cores))}

        exact, compact = ADAM_STATE["fp32"], ADAM_STATE["8bit"]
        return replace(self, cpu_cores=cores, cpu_adam=table(exact), cpu_adam8=table(compact))

    def cpu_table(self, state: AdamState) -> dict[int, CpuAdamRate]:
        """The per-rank CPU Adam rates measured for ``state`` (``cpu_adam`` or ``cpu_adam8``)."""
        return self.cpu_adam8 if state.quantized else self.cpu_adam

    def rates(
        self,
        n: int,
        busbw: float | None = None,
        ranks_per_host: int | None = None,
        state: AdamState = ADAM_STATE["fp32"],
    ) -> Rates:
        """Per-rank rates for ``n`` ranks, ``ranks_per_host`` of them (default all ``n``) on each host
        like this one (see [Note: more GPUs than measured]); ``busbw``: the collective bus bandwidth
        measured on the job's own process group, which replaces the profile's peer-copy proxy;
        ``state``: the optimizer state the Adam rates are of.

        [Note: rates of another state] The 8-bit kernels move 16 bytes an element against exact's 28,
        but their table lookups cost compute: measured, the 8-bit CPU update ran faster than exact's on
        one host and at under half its rate on another (docs/kernels.md). So no ratio carries from one
        machine to another: where the profile has no
        rate for ``state`` (measured before 8-bit moments, or a rank count only the exact state was
        measured for), the exact state's rates stand in, and the notes say so."""
        notes: list[str] = []
        ranks = ranks_per_host or n
        gpu_adam = (self.gpu_adam8 or self.gpu_adam) if state.quantized else self.gpu_adam
        if state.quantized and (self.gpu_adam8 is None or ranks not in self.cpu_adam8):
            notes.append(
                f"{state.moments} moments' Adam rates not measured here: priced at the exact state's "
                "(measure them with `elixir-plan --measure-hardware PATH`, or let a job here measure them)"
            )
            cpu = self.cpu_adam_per_rank(ranks, notes, ADAM_STATE["fp32"])
        else:
            cpu = self.cpu_adam_per_rank(ranks, notes, state)
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
            gpu_adam=gpu_adam,
            cpu_adam=cpu.under_copies,
            cpu_adam_alone=cpu.alone,
            cpu_update_observed=cpu.observed,
            cpu_threads=cpu.threads,
            matmul={int(k): v for k, v in self.matmul.items()},
            gemms=dict(self.gemms),
            attention={int(k): v for k, v in self.attention.items()},
            memory_bandwidth=self.memory_bandwidth,
            elementwise=self.elementwise or ELEMENTWISE_OF_COPY * self.memory_bandwidth,
            op_overhead=self.op_overhead,
            notes=notes,
        )

    def cpu_adam_per_rank(self, ranks: int, notes: list[str], state: AdamState = ADAM_STATE["fp32"]) -> CpuAdamRate:
        """The rate measured for ``ranks`` ranks sharing the host; else the nearest measured count's
        host total (the fewest above if none is below) shared among them, which ``notes`` says."""
        table = self.cpu_table(state)
        if ranks in table:
            return table[ranks]
        if not table:
            raise ValueError(
                f"hardware profile {self.source!r} has no CPU Adam rate: measure it again with "
                "`elixir-plan --measure-hardware PATH`"
            )
        m = max((k for k in table if k <= ranks), default=min(table))
        base = table[m]
        notes.append(
            f"CPU Adam for {ranks} ranks per host not measured: {m} ranks' rate shared among {ranks} "
            "(re-measure with `elixir-plan --measure-hardware`, or let a job on this machine measure it)"
        )
        threads = cpu_adam_threads(ranks, cores=self.cpu_cores)  # what the engine would run with
        share = m / ranks
        return CpuAdamRate(
            ranks,
            threads,
            base.under_copies * share,
            base.alone * share if base.alone else None,
            base.observed * share if base.observed else None,
        )


@dataclass
class Rates:
    """What one of ``n`` ranks gets: its share of the host's links and CPU, its GPU's own rates
    (bytes/s, FLOP/s, parameters/s; ``op_overhead`` in seconds)."""

    n: int
    h2d: float
    d2h: float
    duplex: float | None
    busbw: float | None
    gpu_adam: float
    cpu_adam: float
    matmul: dict[int, float]
    gemms: dict[str, float]
    attention: dict[int, float]
    memory_bandwidth: float
    elementwise: float
    """Bytes/s of the step's memory-bound ops (``HardwareProfile.elementwise``)."""
    op_overhead: float
    cpu_adam_alone: float | None = None
    cpu_update_observed: float | None = None
    """The rate a job on this machine observed its updates of offloaded chunks at (``CpuAdamRate.observed``)."""
    cpu_threads: int | None = None
    """OpenMP threads per rank the CPU Adam rate was measured with."""
    notes: list[str] = field(default_factory=list)

    def flop_rate(self, size_class: str) -> float:
        """A GEMM's shape (``"8192x1024x4096"``) at its own timed rate, else at the measured square
        size nearest (in log space) its dimensions' geometric mean; fused attention by sequence length
        (``"attention:2048"``), the nearest measured; convolutions at the largest GEMM rate.

        [Note: GEMMs by shape] cuBLAS's rate depends on the shape, not only on its FLOPs: a tall,
        thin GEMM (a GQA projection's) runs below the square of its geometric mean, which
        ``benchmarks.compute_split`` shows (docs/planning.md, "The compute split"). A job on a GPU
        times its step's shapes there before the search (``planner``), and this machine's profile
        keeps them."""
        keys = attention_keys(size_class)
        if keys is not None:
            return _nearest(self.attention, keys)
        if size_class in self.gemms:
            return self.gemms[size_class]
        shape = gemm_shape(size_class)
        if shape is not None:
            return _nearest(self.matmul, math.prod(shape) ** (1 / 3))
        if not size_class.isdigit():
            return max(self.matmul.values())
        return _nearest(self.matmul, int(size_class))


def _nearest(rates: dict[int, float], size: float) -> float:
    return rates[min(rates, key=lambda s: abs(math.log2(s) - math.log2(size)))]
