"""Which hardware profile a plan uses: a shipped card, a file, or this machine's, measured once and cached.

A profile is cached per machine under ``~/.cache/elixir/`` (``$ELIXIR_CACHE_DIR``) and can be
replaced by a file (``--hardware``, ``$ELIXIR_HARDWARE``), e.g. one measured on the GPU machine a
plan is made for, or by the name of a card shipped with the package (``SHIPPED``: measured on that
card with ``elixir-plan --measure-hardware``, ``MEASURED``, or derived from the measured one and the
card's published figures, ``cards.py``), which is what ``elixir-plan`` plans with on a machine
without a GPU: a GPU plan is never timed with a CPU's rates.

A job (``job_hardware``) plans with rank 0's profile, shared with every rank; where this machine's
cached profile lacks the per-rank CPU Adam for the job's ranks per host and threads, the job's
ranks measure it together first ([Note: CPU Adam per rank] in ``measure.py``) and rank 0 caches it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import torch

from ..adam_state import ADAM_STATE, AdamState
from ..distributed.collectives import Collectives
from ..host import local_ranks
from ..kernels.threads import cpu_adam_threads
from . import measure
from .cards import CARDS, REFERENCE, derive
from .profile import PROFILE_VERSION, UNREADABLE, HardwareProfile, gemm_shape

__all__ = [
    "cache_path",
    "machine_key",
    "load_hardware",
    "job_hardware",
    "own_profile",
    "record_update_rate",
    "with_step_gemms",
    "shipped_hardware",
    "unknown_card",
    "ENV_HARDWARE",
    "MEASURED",
    "SHIPPED",
]

logger = logging.getLogger(__name__)

ENV_HARDWARE = "ELIXIR_HARDWARE"

SHIPPED = tuple(CARDS)
"""The cards ``--gpu`` and ``--hardware`` take by name (``cards.CARDS``)."""

MEASURED = {"h100": "h100.json"}
"""Cards shipped as a profile measured on them, in ``hardware/profiles/`` (the host each was measured
on: its ``source`` field and docs/planning.md, "The hardware profile"); the other cards' are derived
from ``cards.REFERENCE``'s."""


def shipped_hardware(name: str) -> HardwareProfile:
    """The shipped profile of card ``name`` (``SHIPPED``): measured on it, else derived; its
    ``source`` says which, and that it is the shipped one."""
    key = name.lower()
    if key not in CARDS:
        raise ValueError(unknown_card(name))
    profile = _measured(key) if key in MEASURED else derive(_measured(REFERENCE), CARDS[key])
    profile.source = f"shipped profile {key!r}, {profile.source}"
    return profile


def _measured(name: str) -> HardwareProfile:
    return HardwareProfile.from_json(resources.files(__package__).joinpath("profiles", MEASURED[name]).read_text())


def unknown_card(name: str, file: bool = False) -> str:
    """What to say of a card name (``file``: or a profile file) that is not known, and the fix."""
    return (
        f"{name!r} is no card elixir-plan knows{' and no profile file' if file else ''}: the shipped cards are "
        f"{', '.join(SHIPPED)}. For another card, run `elixir-plan --measure-hardware hw.json` on a machine with it "
        "and plan with `--hardware hw.json` (or add its published figures to CARDS in elixir_runtime/hardware/cards.py)"
    )


def cache_path(key: str | None = None) -> Path:
    """``~/.cache/elixir/hardware-<machine>.json`` (``$ELIXIR_CACHE_DIR`` overrides the root)."""
    root = Path(os.environ.get("ELIXIR_CACHE_DIR") or Path.home() / ".cache" / "elixir")
    return root / f"hardware-{key or machine_key()}.json"


def machine_key() -> str:
    """Host name and GPU model/count: a profile is reused only on the same machine."""
    import torch

    gpus = "cpu"
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()}x{torch.cuda.get_device_name(0)}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{platform.node()}-{gpus}")


def load_hardware(
    path: str | Path | None = None, *, refresh: bool = False, quick: bool = False, ranks: Sequence[int] | None = None
) -> HardwareProfile:
    """A shipped profile's name or a file (``path`` or ``$ELIXIR_HARDWARE``) if given, else this
    machine's cached profile, measured (and cached) on first use and again where it is of an older
    ``PROFILE_VERSION`` (``_cached``), with the per-rank CPU Adam of ``ranks`` ranks per host (default
    ``measure.rank_counts()``) measured where missing."""
    path = path or os.environ.get(ENV_HARDWARE)
    if path and str(path).lower() in SHIPPED:
        return shipped_hardware(str(path))
    if path and not Path(path).exists():
        raise FileNotFoundError(unknown_card(str(path), file=True))
    if path:
        return HardwareProfile.load(path)
    cached = cache_path()
    profile = _cached(cached) if not refresh else None
    changed = profile is None or profile.version < PROFILE_VERSION  # an older measurement is measured again
    if profile is None or changed:
        profile = measure.measure_hardware(quick=quick, ranks=())
    for n in measure.rank_counts() if ranks is None else ranks:
        for state in ADAM_STATE.values():
            if n not in profile.cpu_table(state):
                profile.cpu_table(state)[n] = measure.host_cpu_adam(n, quick=quick, state=state)
                changed = True
    if changed:
        profile.save(cached)
    return profile


def _cached(path: Path) -> HardwareProfile | None:
    """The cached profile, or ``None`` (measure it again) where there is none or it cannot be read,
    a version this release no longer reads (``OLDEST_VERSION``) included: that one is a cache, so it is
    measured again with a warning rather than refused."""
    if not path.exists():
        return None
    try:
        return HardwareProfile.from_json(path.read_text(), str(path))
    except UNREADABLE as exc:
        logger.warning(
            "elixir: the cached hardware profile %s cannot be read (%s): measuring this machine again", path, exc
        )
        return None


def job_hardware(
    coll: Collectives,
    device: torch.device,
    cpu_threads: int | None = None,
    *,
    quick: bool = False,
    state: AdamState = ADAM_STATE["fp32"],
) -> HardwareProfile:
    """The profile a job plans with, the same on every rank (every rank calls it): rank 0's
    ``load_hardware`` (which measures nothing of the CPU Adam: the other ranks wait meanwhile),
    then, where it is this machine's cached profile and lacks the per-rank CPU Adam of this host's
    ranks with the engine's threads (``cpu_adam_threads(local_ranks(), cpu_threads)``), that rate
    measured by all ranks at once (``measure.job_cpu_adam``) and cached by rank 0. A profile given
    as a file or a shipped name is planned with as it is. ``quick``: small sizes, for tests;
    ``state``: the optimizer state the job keeps, whose CPU Adam is measured."""
    ranks = local_ranks()
    threads = cpu_adam_threads(ranks, cpu_threads)

    def load() -> tuple[HardwareProfile, bool]:
        return load_hardware(ranks=(), quick=quick), own_profile()

    profile, own = coll.decided_by_rank0(load, device)
    table = profile.cpu_table(state)
    rate = table.get(ranks)
    if own and (rate is None or rate.threads != threads):
        table[ranks] = measure.job_cpu_adam(coll, device, ranks, threads, quick=quick, state=state)
        if coll.rank == 0:
            profile.save(cache_path())
    return profile


def own_profile() -> bool:
    """Whether a job here plans with this machine's cached profile (no ``$ELIXIR_HARDWARE``): only that
    one is measured further and cached; a file or a shipped card is planned with as it is."""
    return not os.environ.get(ENV_HARDWARE)


def with_step_gemms(
    profile: HardwareProfile, classes: Iterable[str], dtype: torch.dtype, device: torch.device
) -> HardwareProfile:
    """``profile``, this machine's own, with the rates of the GEMM shapes among ``classes`` (a profiled
    step's size classes) that it lacks, timed on ``device`` and cached ([Note: GEMMs by shape] in
    ``profile.py``). Shapes of another dtype than the profile's are not timed."""
    missing = {c for c in classes if gemm_shape(c) is not None and c not in profile.gemms}
    if not missing or str(dtype).removeprefix("torch.") != profile.dtype:
        return profile
    profile = dataclasses.replace(profile, gemms={**profile.gemms, **measure.gemm_rates(missing, dtype, device)})
    try:  # the profile is a cache: failing to update it must not fail the job
        profile.save(cache_path())
    except OSError as exc:
        logger.warning("elixir: could not cache the GEMM rates in %s (%s)", cache_path(), exc)
    return profile


def record_update_rate(
    coll: Collectives, device: torch.device, ranks: int, threads: int, rate: float, state: AdamState
) -> float:
    """The slowest rank's ``rate`` (a job's CPU updates of offloaded chunks after a synced backward,
    per rank: ``runtime/update_rate.py``), which rank 0 records as ``observed`` in this machine's
    cached profile, in its entry for ``ranks`` ranks per host with ``threads`` threads (of the job's
    optimizer ``state``: ``HardwareProfile.cpu_table``); every rank
    calls it. Nothing is recorded where some rank has no rate (0), where the job planned with a
    profile file (``$ELIXIR_HARDWARE``) or where the cached entry is another measurement's. On
    several hosts the job's slowest rank is recorded on rank 0's host only."""
    slowest = torch.tensor([-rate], dtype=torch.float64, device=device)
    coll.all_reduce_max_(slowest)
    rate = max(0.0, -float(slowest[0]))
    path = cache_path()
    if coll.rank != 0 or rate <= 0 or os.environ.get(ENV_HARDWARE) or not path.exists():
        return rate
    try:  # the profile is a cache: failing to update it must not fail the training step
        profile = HardwareProfile.load(path)
        entry = profile.cpu_table(state).get(ranks)
        if entry is None or entry.threads != threads:
            return rate
        before, entry.observed = entry.observed, rate
        profile.save(path)
    except UNREADABLE as exc:
        logger.warning("elixir: could not record this job's CPU update rate in %s (%s)", path, exc)
        return rate
    logger.info(
        "elixir: this job's CPU updated offloaded chunks at %.2f G params/s per rank (the profile measured %s alone%s); "
        "recorded in %s for the next plan made on this machine",
        rate / 1e9,
        f"{entry.alone / 1e9:.2f}" if entry.alone else "-",
        f", a job before {before / 1e9:.2f}" if before else "",
        path,
    )
    return rate
