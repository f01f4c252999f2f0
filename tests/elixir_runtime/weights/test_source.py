"""``weights.source``: the hint for jobs whose every rank holds its own copy of the weights."""

from __future__ import annotations

from elixir_runtime.weights.source import copies_warning

GIB = 2**30


def test_copies_that_crowd_the_host_get_the_fix() -> None:
    hint = copies_warning(80 * GIB, 4, 512 * GIB)  # a 20B model in fp32 on four ranks
    assert hint is not None and "4 x 80.0 GiB of 512 GiB" in hint and "elixir_hf.from_pretrained" in hint


def test_small_models_and_single_ranks_pass_quietly() -> None:
    assert copies_warning(GIB, 4, 512 * GIB) is None
    assert copies_warning(400 * GIB, 1, 512 * GIB) is None  # one rank: its copy is the only one
