"""The traced step as a sequence of segments, and how a few traced blocks stand for all of them.

A segment is a stretch of the step between two markers (before the blocks, the forward of block
``i``, the head and loss, the backward of block ``i``, after the blocks). Each keeps the live
bytes at its start and its peak, both also without the held block inputs (``runtime/held_inputs.py``:
what the peak is with them on the host), its compute, the parameters first used in it, the fetch-unit
events and the checkpointed regions that began in it. Everything is recorded by name, so a
segment traced on block ``r`` can be replayed as block ``i`` by renaming.

[Note: block extrapolation] For a stack of ``L`` identical blocks the profiler traces only the
first ``k = 3``. Block 0 and the head/tail are traced exactly; block 1 stands for blocks
``1 .. L-2`` and block 2 for block ``L-1``. The only thing that differs between copies is how
much earlier blocks left alive (saved activations or checkpoint inputs): ``delta``, the growth of
the live bytes from the start of block 1's forward to the start of block 2's. A segment replayed
as block ``i`` is shifted by ``(i - r) * delta``; the head and loss by ``(L - k) * delta``. The live
bytes without the held inputs are replayed the same way, with their own ``delta``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Cost", "UnitEvent", "Region", "Segment", "Timeline", "BlockPlan", "Replay", "replay"]


@dataclass
class Cost:
    """Compute of a stretch of the step: FLOPs by size class (see ``costs.py``), bytes streamed
    by the other ops, and the number of ops (each costs a dispatch and a kernel launch)."""

    flops: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    ops: int = 0

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def add(self, other: Cost, times: int = 1) -> None:
        for cls, f in other.flops.items():
            self.flops[cls] = self.flops.get(cls, 0) + f * times
        self.bytes += other.bytes * times
        self.ops += other.ops * times


@dataclass
class UnitEvent:
    """A fetch unit acquiring its chunks (the engine's pre-forward / pre-backward hook)."""

    unit: str
    phase: str
    before: Cost
    """Compute since the previous event of the same segment (or the segment's start)."""


@dataclass
class Region:
    """An activation-checkpointed call and the parameters its forward touched."""

    name: str
    params: list[str] = field(default_factory=list)


@dataclass
class Segment:
    label: str
    block: int | None
    phase: str
    start: int
    peak: int
    start_unheld: int = 0
    """``start`` less the held block inputs alive then."""
    peak_unheld: int = 0
    """The most live bytes less the held block inputs alive at the moment."""
    cost: Cost = field(default_factory=Cost)
    params: list[str] = field(default_factory=list)
    events: list[UnitEvent] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)


class Timeline:
    """Live-byte accounting and per-segment records, fed by the recorder and the hooks."""

    def __init__(self) -> None:
        self.live = 0
        self.held = 0
        """Of ``live``: the held block inputs (``hold``)."""
        self.largest_held = 0
        self.phase = "fwd"
        self.segments: list[Segment] = [Segment("pre", None, "fwd", 0, 0)]
        self._since_event = Cost()
        self._used: set[str] = set()
        self._open_regions: list[Region] = []

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        seg = self.current
        seg.peak = max(seg.peak, self.live)
        seg.peak_unheld = max(seg.peak_unheld, self.live - self.held)

    def free(self, nbytes: int, held: bool = False) -> None:
        self.live -= nbytes
        if held:
            self.held -= nbytes

    def hold(self, nbytes: int) -> None:
        """Of the live bytes, ``nbytes`` are now a held block input."""
        self.held += nbytes
        self.largest_held = max(self.largest_held, nbytes)

    def mark(self, label: str, block: int | None = None) -> None:
        unheld = self.live - self.held
        self.segments.append(Segment(label, block, self.phase, self.live, self.live, unheld, unheld))
        self._since_event = Cost()

    def add_cost(self, flops: int, size_class: str, moved: int) -> None:
        for c in (self.current.cost, self._since_event):
            if flops:
                c.flops[size_class] = c.flops.get(size_class, 0) + flops
            c.bytes += moved
            c.ops += 1

    def kernel_launch(self, moved: int) -> None:
        """A custom kernel the fake trace skipped (``launches.py``): its traffic, as one op."""
        self.add_cost(0, "", moved)

    def use_param(self, name: str) -> None:
        if self.phase != "fwd":
            return
        if name not in self._used:
            self._used.add(name)
            self.current.params.append(name)
        for region in self._open_regions:
            if not region.params:  # a region belongs to the segment where it first touches a param
                self.current.regions.append(region)
            if name not in region.params:
                region.params.append(name)

    def unit_event(self, unit: str) -> None:
        self.current.events.append(UnitEvent(unit, self.phase, self._since_event))
        self._since_event = Cost()

    def region_begin(self, name: str) -> Region | None:
        if self.phase != "fwd":
            return None
        region = Region(name)
        self._open_regions.append(region)
        return region

    def region_end(self, region: Region | None) -> None:
        """Closes ``region``. It was attached at its first parameter use, not at its start: HF
        layers may enter the checkpoint before the block's own forward hook marks its segment
        (transformers 5.17's ``GradientCheckpointingLayer``); one that used no parameter is
        attached here."""
        if region is not None:
            self._open_regions.remove(region)
            if not region.params:
                self.current.regions.append(region)


@dataclass(frozen=True)
class BlockPlan:
    """``profiled`` of ``total`` identical blocks named ``{prefix}.{i}`` were traced."""

    prefix: str
    total: int
    profiled: int

    def rename(self, name: str, src: int | None, dst: int | None) -> str:
        if src is None or src == dst:
            return name
        old = f"{self.prefix}.{src}"
        if name == old or name.startswith(old + "."):
            return f"{self.prefix}.{dst}{name[len(old) :]}"
        return name


@dataclass
class Replay:
    """One traced segment standing for one segment of the full step."""

    segment: Segment
    block: int | None
    shift: int
    shift_unheld: int = 0
    """``shift`` of the live bytes less the held block inputs."""

    @property
    def peak(self) -> int:
        return self.segment.peak + self.shift

    @property
    def peak_unheld(self) -> int:
        return self.segment.peak_unheld + self.shift_unheld

    @property
    def held_at_start(self) -> int:
        """Held block inputs alive at the segment's start."""
        return self.segment.start + self.shift - self.segment.start_unheld - self.shift_unheld

    def rename(self, plan: BlockPlan | None, name: str) -> str:
        return plan.rename(name, self.segment.block, self.block) if plan else name


def replay(segments: list[Segment], plan: BlockPlan | None) -> list[Replay]:
    """The full step's segments, in order (see [Note: block extrapolation])."""
    if plan is None:
        return [Replay(s, s.block, 0) for s in segments]
    fwd = {s.block: s for s in segments if s.label == "fwd"}
    delta = fwd[2].start - fwd[1].start
    delta_u = fwd[2].start_unheld - fwd[1].start_unheld
    total, extra = plan.total, plan.total - plan.profiled
    out: list[Replay] = []
    for s in segments:
        if s.block is None:
            grown = extra if s.label in ("mid", "head") else 0
            out.append(Replay(s, None, grown * delta, grown * delta_u))
        elif s.block == 0:
            out.append(Replay(s, 0, 0))
        elif s.block == 1:
            order = range(1, total - 1) if s.phase == "fwd" else range(total - 2, 0, -1)
            out += [Replay(s, i, (i - 1) * delta, (i - 1) * delta_u) for i in order]
        elif s.block == plan.profiled - 1:
            out.append(Replay(s, total - 1, extra * delta, extra * delta_u))
    return out
