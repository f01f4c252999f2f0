"""Where every parameter lives: chunks in use order, offsets inside them, and shard ranges.

Pure bookkeeping (no tensors are allocated here), so an impossible plan can be rejected before a
byte of memory is touched. Rules:

* parameters are packed in first-use order into chunks of ``chunk_size`` elements; a parameter
  never spans two chunks. On one rank a chunk ends at its last parameter (rounded up to
  ``alignment``): padding would carry optimizer state like parameters. On several ranks every
  public chunk keeps ``chunk_size``: ranks that reduce chunks in different orders (a parameter used
  on some ranks only, see ``ChunkGradients.used_params``) then still pair collectives of one size, and
  the engine names the parameter where gloo would abort on the size mismatch;
* a parameter used by more than one unit (tied ``wte``/``lm_head``) gets a *private* chunk of its
  own that is never evicted; so does one read outside its module's call (``units.ParamTable.resident``);
* so does a parameter larger than ``chunk_size`` (an untied embedding or ``lm_head``): its chunk
  is sized to it and its buffer is its own, so the rCache blocks stay ``chunk_size``;
* frozen parameters go to frozen chunks (no grad, no optimizer state);
* inside a trainable chunk parameters are sorted by optimizer param group, so each rank's shard
  meets every group in at most one contiguous segment (one kernel range per group, not per param).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = ["GroupRange", "Slot", "ChunkSpec", "ChunkLayout", "build_layout", "round_up"]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class GroupRange:
    """A contiguous arena range ``[offset, offset + length)`` updated with group ``group``'s hypers."""

    offset: int
    length: int
    group: int


@dataclass(frozen=True, slots=True)
class Slot:
    """Parameter ``param`` occupies ``[offset, offset + numel)`` of its chunk."""

    param: int
    offset: int
    numel: int


@dataclass(slots=True)
class ChunkSpec:
    index: int
    numel: int
    trainable: bool
    private: bool
    """The chunk has a buffer of its own, outside the rCache, never evicted: it holds one multi-use
    parameter, or one larger than ``chunk_size``."""
    slots: list[Slot] = field(default_factory=list)
    group_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """``(start, end, group)`` covering ``[0, numel)`` for trainable chunks; empty for frozen ones."""

    def shard_segments(self, rank: int, world_size: int) -> list[tuple[int, int, int]]:
        """``(offset within the shard, length, group)`` of rank ``rank``'s shard, in order."""
        size = self.numel // world_size
        lo, hi = rank * size, (rank + 1) * size
        out = []
        for start, end, group in self.group_ranges:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                out.append((a - lo, b - a, group))
        return out


@dataclass(slots=True)
class ChunkLayout:
    chunk_size: int
    world_size: int
    alignment: int
    params: list[nn.Parameter]
    names: list[list[str]]
    """Every name each parameter is reachable under (tied weights have several)."""
    groups: list[int]
    """Optimizer param-group index of each parameter (-1 for frozen ones)."""
    chunks: list[ChunkSpec]
    param_chunk: list[int] = field(default_factory=list)
    param_slot: list[Slot] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.param_chunk = [0] * len(self.params)
        self.param_slot = [Slot(0, 0, 0)] * len(self.params)
        for c in self.chunks:
            for s in c.slots:
                self.param_chunk[s.param] = c.index
                self.param_slot[s.param] = s

    @property
    def block_numel(self) -> int:
        """Elements of one rCache block: the largest public chunk (at most ``chunk_size``)."""
        return max((c.numel for c in self.chunks if not c.private), default=0)

    def shard_numel(self, chunk: ChunkSpec) -> int:
        return chunk.numel // self.world_size

    def chunks_of(self, params: Iterable[int]) -> tuple[int, ...]:
        """The chunks holding these parameters (table indices), in chunk order."""
        return tuple(sorted({self.param_chunk[i] for i in params}))

    def block_bounds(self, together: Iterable[Sequence[int]]) -> tuple[int, int]:
        """(min, max) useful rCache blocks. Each set of chunks in ``together`` must be in the rCache
        at once: a unit's while it runs, and a checkpointed region's from its recomputation to the
        end of its backward (the recomputed saved tensors are raw views of the blocks, so no chunk
        of the region may be evicted in between). Private chunks have blocks of their own."""
        public = {c.index for c in self.chunks if not c.private}
        lo = max((len(public.intersection(cs)) for cs in together), default=0)
        return lo, max(lo, len(public))

    def fingerprint(self) -> str:
        """Identifies the layout: a sharded optimizer state only loads into the same one."""
        h = hashlib.sha256(f"{self.world_size}|{self.chunk_size}|{self.alignment}".encode())
        for c in self.chunks:
            h.update(f"|{c.numel}:{int(c.trainable)}".encode())
            for s in c.slots:
                h.update(f",{self.names[s.param][0]}@{s.offset}+{s.numel}".encode())
        return h.hexdigest()[:16]


def build_layout(
    params: Sequence[nn.Parameter],
    names: Sequence[list[str]],
    groups: Sequence[int],
    private: Sequence[bool],
    *,
    world_size: int,
    chunk_size: int | None,
    alignment: int,
) -> ChunkLayout:
    """Packs ``params`` (already in first-use order) into chunks.

    ``groups[i] == -1`` marks a frozen parameter; ``private[i]`` a multi-use one. A parameter larger
    than ``chunk_size`` gets a private chunk of its own as well.
    """
    quantum = world_size * alignment
    numels = [p.numel() for p in params]
    aligned = [round_up(n, alignment) for n in numels]
    public = [a for a, priv in zip(aligned, private) if not priv]
    if chunk_size is None:
        chunk_size = default_chunk_size(sum(public), max(public, default=alignment))
    chunk_size = round_up(chunk_size, quantum)
    private = [priv or a > chunk_size for priv, a in zip(private, aligned)]

    chunks: list[ChunkSpec] = []
    open_chunk: dict[bool, tuple[ChunkSpec, list[int]] | None] = {True: None, False: None}

    def close(trainable: bool) -> None:
        entry = open_chunk[trainable]
        if entry is not None:
            if world_size == 1:  # no padding past the last param (see the module docstring)
                entry[0].numel = round_up(sum(aligned[j] for j in entry[1]), quantum)
            _place(entry[0], entry[1], aligned, groups, numels)
            open_chunk[trainable] = None

    for i in range(len(params)):
        trainable = groups[i] >= 0
        if private[i]:
            spec = ChunkSpec(len(chunks), round_up(aligned[i], quantum), trainable, private=True)
            chunks.append(spec)
            _place(spec, [i], aligned, groups, numels)
            continue
        entry = open_chunk[trainable]
        if entry is not None and sum(aligned[j] for j in entry[1]) + aligned[i] > chunk_size:
            close(trainable)
            entry = None
        if entry is None:
            spec = ChunkSpec(len(chunks), chunk_size, trainable, private=False)
            chunks.append(spec)
            entry = open_chunk[trainable] = (spec, [])
        entry[1].append(i)
    close(True)
    close(False)
    return ChunkLayout(chunk_size, world_size, alignment, list(params), [list(n) for n in names], list(groups), chunks)


def default_chunk_size(total: int, largest: int) -> int:
    """About eight chunks for small models, 32 Mi elements (64 MiB in bf16) for large ones."""
    return max(largest, min(32 * 2**20, -(-total // 8)))


def _place(
    spec: ChunkSpec, members: list[int], aligned: Sequence[int], groups: Sequence[int], numels: Sequence[int]
) -> None:
    """Assigns offsets sorted by group (stable in use order) and the group ranges."""
    members = sorted(members, key=lambda i: groups[i])
    offset = 0
    ranges: list[tuple[int, int, int]] = []
    for i in members:
        if spec.trainable and (not ranges or ranges[-1][2] != groups[i]):
            if ranges:
                ranges[-1] = (ranges[-1][0], offset, ranges[-1][2])
            ranges.append((offset, offset, groups[i]))
        spec.slots.append(Slot(i, offset, numels[i]))
        offset += aligned[i]
    if ranges:
        ranges[-1] = (ranges[-1][0], spec.numel, ranges[-1][2])
        ranges[0] = (0, ranges[0][1], ranges[0][2])
    spec.group_ranges = ranges
