"""What the search reports beside its choice, frozen and typed: the plan file's ``search`` and
``alternatives`` (``plan.py``), and what ``elixir-plan --verbose`` and the run's logs render.

Each record reads and writes the JSON keys plans have always had (``to_dict``/``from_dict``), so
plan files written before these types load unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..hardware.profile import HardwareProfile, Rates
from .step_time import StepTime

__all__ = ["ActivationsOption", "Alternative", "Candidate", "MomentsOption", "RateSummary", "SearchReport"]


@dataclass(frozen=True)
class Candidate:
    """One chunk size the search tried; the placement's figures are ``None`` where none fits."""

    chunk_size: int
    n_chunks: int
    min_blocks: int
    n_blocks: int | None
    offloaded: int | None
    rcache_gib_per_step: float | None
    """GiB gathered into the rCache per step (the paper's chunk-size criterion)."""
    step_s: float | None
    serial_s: float | None

    @property
    def fits(self) -> bool:
        return self.step_s is not None


@dataclass(frozen=True)
class Alternative:
    """A rigid plan of the chosen layout (``zero2-offload-all``, ``zero3-offload-all``,
    ``rcache-max``, ``rcache-min``) with its memory and predicted step."""

    name: str
    n_blocks: int
    offloaded: int
    device_bytes: int
    host_bytes: int
    fits: bool
    time: StepTime

    def to_dict(self) -> dict[str, object]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "time": self.time.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Alternative:
        return cls(**{**data, "time": StepTime.from_dict(data["time"])})


@dataclass(frozen=True)
class MomentsOption:
    """The same job searched with another way of storing Adam's moments (``ElixirConfig.moments``):
    what switching would buy, shown beside the plan and never switched to by itself."""

    moments: str
    offloaded: int
    n_chunks: int
    device_bytes: int
    host_bytes: int
    step_s: float
    """Its predicted seconds per optimizer step."""


@dataclass(frozen=True)
class ActivationsOption:
    """The same job searched with the held block inputs in the other memory tier
    (``ElixirConfig.activations``): the choice the planner did not make, and why."""

    where: str
    """``"device"`` or ``"host"``."""
    held_bytes: int
    """The held block inputs' bytes (``ModelProfile.held_inputs``)."""
    offloaded: int | None
    """Chunks it offloads; ``None``: no plan fits."""
    n_chunks: int | None
    step_s: float | None
    """Its predicted seconds per optimizer step; ``None``: no plan fits."""


@dataclass(frozen=True)
class RateSummary:
    """The per-rank rates a plan was predicted with (GB/s, G params/s; ``Rates``), and the CPU
    update's rate as the step model priced it (``cpu_update_Gps``: ``StepModel.cpu_rate``).
    ``None``: not measured (or not recorded by the plan's version)."""

    ranks: int | None = None
    h2d_GBps: float | None = None
    d2h_GBps: float | None = None
    duplex_GBps: float | None = None
    busbw_GBps: float | None = None
    gpu_adam_Gps: float | None = None
    cpu_adam_Gps: float | None = None
    cpu_adam_alone_Gps: float | None = None
    cpu_update_observed_Gps: float | None = None
    cpu_threads: int | None = None
    """OpenMP threads per rank the CPU Adam rate was measured with."""
    cpu_update_Gps: float | None = None

    @classmethod
    def of(cls, rates: Rates, cpu_update: float) -> RateSummary:
        """``rates`` and the CPU update rate ``cpu_update`` (elements/s), rounded as recorded."""
        return cls(
            ranks=rates.n,
            h2d_GBps=_giga(rates.h2d),
            d2h_GBps=_giga(rates.d2h),
            duplex_GBps=_giga(rates.duplex),
            busbw_GBps=_giga(rates.busbw),
            gpu_adam_Gps=_giga(rates.gpu_adam),
            cpu_adam_Gps=_giga(rates.cpu_adam),
            cpu_adam_alone_Gps=_giga(rates.cpu_adam_alone),
            cpu_update_observed_Gps=_giga(rates.cpu_update_observed),
            cpu_threads=rates.cpu_threads,
            cpu_update_Gps=round(cpu_update / 1e9, 3),
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _giga(x: float | None) -> float | None:
    return round(x / 1e9, 3) if x else None


@dataclass(frozen=True)
class SearchReport:
    """Why a searched plan is what it is: I(n)/J(n) at the choice, every chunk size tried, the
    search's notes and time, the rates it priced with and the whole hardware profile (enough to
    predict the same plan again offline: ``benchmarks.replay``)."""

    i_per_gib: float | None
    """Seconds one more rCache block would save per GiB at the choice (``None``: none left)."""
    j_per_gib: float | None
    """Seconds uploading the next offloaded chunk would save per GiB (``None``: none left)."""
    candidates: tuple[Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    rates: RateSummary | None = None
    hardware: HardwareProfile | None = None
    """A copy of the profile searched with: read it, never change it."""
    moments: tuple[MomentsOption, ...] = ()
    """The job searched with the other moments where this plan offloads (``planner``); empty otherwise."""
    activations: tuple[ActivationsOption, ...] = ()
    """The job searched with the held block inputs in the other tier, where the planner chose (``planner``)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "i_per_gib": self.i_per_gib,
            "j_per_gib": self.j_per_gib,
            "candidates": [asdict(c) for c in self.candidates],
            "notes": list(self.notes),
            "seconds": self.seconds,
            "rates": None if self.rates is None else self.rates.to_dict(),
            "hardware": None if self.hardware is None else self.hardware.to_dict(),
            **({"moments": [asdict(m) for m in self.moments]} if self.moments else {}),  # files before it lack it
            **({"activations": [asdict(a) for a in self.activations]} if self.activations else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchReport:
        rates, hardware = data.get("rates"), data.get("hardware")
        return cls(
            i_per_gib=data.get("i_per_gib"),
            j_per_gib=data.get("j_per_gib"),
            candidates=tuple(Candidate(**c) for c in data.get("candidates", ())),
            notes=tuple(data.get("notes", ())),
            seconds=data.get("seconds", 0.0),
            rates=RateSummary(**rates) if rates else None,
            hardware=HardwareProfile.from_dict(hardware) if hardware else None,
            moments=tuple(MomentsOption(**m) for m in data.get("moments", ())),
            activations=tuple(ActivationsOption(**a) for a in data.get("activations", ())),
        )
