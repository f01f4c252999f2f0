"""``build_layout`` on synthetic parameters: packing, alignment, privacy, frozen/trainable
separation, group ordering inside chunks, and the shard ranges every rank derives from it."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from elixir_runtime.chunk.layout import build_layout, round_up


def _params(sizes: list[int]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.empty(n)) for n in sizes]


def _layout(sizes, groups=None, private=None, *, world_size=1, chunk_size=256, alignment=8):
    params = _params(sizes)
    names = [[f"p{i}"] for i in range(len(sizes))]
    groups = list(groups) if groups is not None else [0] * len(sizes)
    private = list(private) if private is not None else [False] * len(sizes)
    layout = build_layout(
        params, names, groups, private, world_size=world_size, chunk_size=chunk_size, alignment=alignment
    )
    return layout, params


def _random_case(seed: int):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    sizes = [rng.randint(1, 200) for _ in range(n)]
    groups = [rng.choice([-1, 0, 0, 1, 2]) for _ in range(n)]
    private = [rng.random() < 0.1 for _ in range(n)]
    world_size = rng.choice([1, 2, 3, 4])
    alignment = rng.choice([1, 4, 8, 16])
    chunk_size = rng.randint(max(sizes) // 3 + 1, 3 * max(sizes) + 50)  # some params larger than a chunk
    return sizes, groups, private, world_size, alignment, chunk_size


CASES = list(range(40))


def test_fixed_packing_example() -> None:
    # sizes 100, 100, 100 aligned to 104 each; chunk 256 holds two of them
    layout, _ = _layout([100, 100, 100, 30], chunk_size=256, alignment=8)
    assert layout.chunk_size == 256
    assert [[s.param for s in c.slots] for c in layout.chunks] == [[0, 1], [2, 3]]
    assert [[s.offset for s in c.slots] for c in layout.chunks] == [[0, 104], [0, 104]]
    assert layout.param_chunk == [0, 0, 1, 1]


def test_chunk_size_rounded_to_world_times_alignment() -> None:
    layout, _ = _layout([10, 20], world_size=3, chunk_size=100, alignment=16)
    assert layout.chunk_size == round_up(100, 48) == 144
    assert all(c.numel % 48 == 0 for c in layout.chunks)


@pytest.mark.parametrize("seed", CASES)
def test_random_layout_invariants(seed: int) -> None:
    sizes, groups, private, world_size, alignment, chunk_size = _random_case(seed)
    layout, params = _layout(sizes, groups, private, world_size=world_size, chunk_size=chunk_size, alignment=alignment)
    quantum = world_size * alignment
    own = [p or round_up(n, alignment) > layout.chunk_size for p, n in zip(private, sizes)]
    """Multi-use parameters and those larger than the chunk size: a private chunk each."""

    # every param placed exactly once, and the per-param lookups agree with the chunk specs
    placed = sorted(s.param for c in layout.chunks for s in c.slots)
    assert placed == list(range(len(sizes)))
    for c in layout.chunks:
        for s in c.slots:
            assert layout.param_chunk[s.param] == c.index
            assert layout.param_slot[s.param] == s
            assert s.numel == sizes[s.param]

    for c in layout.chunks:
        # chunk numel is a multiple of world_size * alignment (shards are equal and aligned)
        assert c.numel % quantum == 0, (c.index, c.numel, quantum)
        if not c.private:  # one rank: as large as its contents; several: chunk_size
            contents = sum(round_up(sizes[s.param], alignment) for s in c.slots)
            assert c.numel == (round_up(contents, alignment) if world_size == 1 else layout.chunk_size)
        # never spans chunks; aligned offsets; no overlap
        end = 0
        for s in sorted(c.slots, key=lambda s: s.offset):
            assert s.offset % alignment == 0
            assert s.offset >= end, "slots overlap"
            assert s.offset + s.numel <= c.numel, "param spans past its chunk"
            end = s.offset + s.numel
        # frozen params never share a chunk with trainable ones
        kinds = {groups[s.param] >= 0 for s in c.slots}
        assert kinds == {c.trainable}
        # multi-use and oversize params get a chunk of their own (sized to them), and only they are private
        if c.private:
            assert len(c.slots) == 1 and own[c.slots[0].param]
            assert c.numel == round_up(round_up(sizes[c.slots[0].param], alignment), quantum)
        else:
            assert not any(own[s.param] for s in c.slots)

    # packed in the given order: for public chunks of one kind, chunk indices never decrease
    # along the param order, and inside a chunk the params of one group keep their order
    for trainable in (True, False):
        seq = [layout.param_chunk[i] for i in range(len(sizes)) if not own[i] and (groups[i] >= 0) == trainable]
        assert seq == sorted(seq)
    for c in layout.chunks:
        by_offset = [s.param for s in sorted(c.slots, key=lambda s: s.offset)]
        for g in set(groups[i] for i in by_offset):
            members = [i for i in by_offset if groups[i] == g]
            assert members == sorted(members)


@pytest.mark.parametrize("seed", CASES)
def test_random_group_ranges_and_shards(seed: int) -> None:
    sizes, groups, private, world_size, alignment, chunk_size = _random_case(seed)
    layout, _ = _layout(sizes, groups, private, world_size=world_size, chunk_size=chunk_size, alignment=alignment)
    for c in layout.chunks:
        if not c.trainable:
            assert c.group_ranges == []
            continue
        by_offset = sorted(c.slots, key=lambda s: s.offset)
        member_groups = [groups[s.param] for s in by_offset]
        # sorted by group inside the chunk
        assert member_groups == sorted(member_groups)
        # group ranges cover [0, numel) contiguously, one range per group, each holding its params
        ranges = c.group_ranges
        assert ranges[0][0] == 0 and ranges[-1][1] == c.numel
        for (_, a1, _), (b0, _, _) in zip(ranges, ranges[1:]):
            assert a1 == b0
        assert all(a < b for a, b, _ in ranges)
        assert [g for _, _, g in ranges] == sorted(set(member_groups))
        for s in c.slots:
            (rng,) = [r for r in ranges if r[2] == groups[s.param]]
            assert rng[0] <= s.offset and s.offset + s.numel <= rng[1]

        # the shard segments of all ranks tile the group ranges exactly
        shard = layout.shard_numel(c)
        assert shard * world_size == c.numel
        covered: list[tuple[int, int, int]] = []
        for rank in range(world_size):
            segs = c.shard_segments(rank, world_size)
            pos = 0
            for off, length, g in segs:
                assert off == pos, "a shard's segments must be contiguous from 0"
                assert length > 0
                covered.append((rank * shard + off, rank * shard + off + length, g))
                pos += length
            assert pos == shard, "a shard's segments must cover the whole shard"
        # merge adjacent same-group pieces and compare with the group ranges
        merged: list[tuple[int, int, int]] = []
        for a, b, g in covered:
            if merged and merged[-1][1] == a and merged[-1][2] == g:
                merged[-1] = (merged[-1][0], b, g)
            else:
                merged.append((a, b, g))
        assert merged == ranges


def test_groups_sorted_within_chunk() -> None:
    layout, _ = _layout([8, 8, 8, 8], groups=[1, 0, 1, 0], world_size=2, chunk_size=64, alignment=8)
    (c,) = layout.chunks
    assert [s.param for s in sorted(c.slots, key=lambda s: s.offset)] == [1, 3, 0, 2]
    assert c.group_ranges == [(0, 16, 0), (16, 64, 1)]
    assert c.shard_segments(0, 2) == [(0, 16, 0), (16, 16, 1)]
    assert c.shard_segments(1, 2) == [(0, 32, 1)]


def test_private_param_gets_own_chunk() -> None:
    layout, _ = _layout([50, 200, 50, 50], private=[False, True, False, False], chunk_size=128, alignment=8)
    priv = layout.chunks[layout.param_chunk[1]]
    assert priv.private and [s.param for s in priv.slots] == [1]
    assert priv.numel == 200  # round_up(200, 8), larger than chunk_size is fine for a private chunk
    assert layout.param_chunk[0] == layout.param_chunk[2] != layout.param_chunk[1]


def test_frozen_and_trainable_interleaved_do_not_share() -> None:
    layout, _ = _layout([8] * 6, groups=[0, -1, 0, -1, 0, -1], chunk_size=1024, alignment=8)
    assert len(layout.chunks) == 2
    train, frozen = (layout.chunks[layout.param_chunk[0]], layout.chunks[layout.param_chunk[1]])
    assert train.trainable and not frozen.trainable
    assert sorted(s.param for s in train.slots) == [0, 2, 4]
    assert sorted(s.param for s in frozen.slots) == [1, 3, 5]


@pytest.mark.parametrize("world_size", [1, 2])
def test_param_larger_than_chunk_gets_a_private_chunk_of_its_size(world_size: int) -> None:
    # an untied embedding and lm_head (300) around two blocks of 2 x 60 (64 each aligned): chunks of
    # 128 hold one block; the big ones get chunks of their own, sized to them
    layout, _ = _layout([300, 60, 60, 60, 60, 20, 300], world_size=world_size, chunk_size=128, alignment=8)
    big = round_up(300, 8 * world_size)
    tail = 24 if world_size == 1 else 128  # one rank: the chunk ends at its last param
    kinds = [(c.private, [s.param for s in c.slots], c.numel) for c in layout.chunks]
    assert kinds == [(True, [0], big), (False, [1, 2], 128), (False, [3, 4], 128), (False, [5], tail), (True, [6], big)]
    assert layout.block_numel == 128  # the rCache blocks stay chunk-sized
    # a chunk size that holds the big ones keeps every chunk public, as before
    layout, _ = _layout([300, 60, 60, 60, 60, 20, 300], world_size=world_size, chunk_size=304, alignment=8)
    assert not any(c.private for c in layout.chunks) and layout.block_numel == 304


def test_private_param_larger_than_chunk_is_allowed() -> None:
    # a tied embedding bigger than chunk_size lives in its own chunk: no error
    layout, _ = _layout([1000, 10], private=[True, False], chunk_size=64, alignment=8)
    assert layout.chunks[layout.param_chunk[0]].numel == 1000
