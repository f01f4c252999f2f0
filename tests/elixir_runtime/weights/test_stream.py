"""``weights.stream``: a flattened range of a tensor read as at most ``2 * ndim - 1`` blocks, and a
torch model on meta filled from a safetensors file by ``prepare`` (names as keys, or a key map)."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import save_file

import elixir_runtime as er
from elixir_runtime.weights.stream import pieces
from helpers.models import make_mlp_batch, tiny_mlp


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_every_range_is_read_exactly(shape) -> None:
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    flat = t.reshape(-1)
    for start, stop in itertools.combinations(range(flat.numel() + 1), 2):
        blocks = pieces(shape, start, stop)
        assert len(blocks) <= 2 * len(shape) - 1
        assert torch.equal(torch.cat([t[idx].reshape(-1) for idx in blocks]), flat[start:stop]), (start, stop)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_meta_model_is_filled_from_its_file(tmp_path) -> None:
    model = tiny_mlp(seed=2, freeze_first=True)
    save_file({f"mlp.{k}": v for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = tiny_mlp(freeze_first=True)
    with pytest.raises(er.WeightsError, match=r"6 parameters have no tensor in .* \(e\.g\. \['layers\.0\.weight'"):
        er.stream_weights(meta, tmp_path)
    er.stream_weights(meta, tmp_path, {name: f"mlp.{name}" for name, _ in meta.named_parameters()})
    params = [p for p in meta.parameters() if p.requires_grad]
    meta, _ = er.prepare(meta, torch.optim.AdamW(params), er.ElixirConfig(mode="static", device="cpu"))
    want = _state(model)
    got = _state(meta)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert meta(**make_mlp_batch()).loss.isfinite()
