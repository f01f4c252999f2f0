"""The model's own init recorded on meta parameters and replayed a range at a time
(``elixir_runtime.init_weights``): any range of a parameter is bitwise the same part of the
whole, whatever the blocks a draw is cut into; each parameter has its init's distribution; an
init that cannot be replayed on a range is refused, naming the parameter and the op."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import elixir_runtime as er
from elixir_runtime.weights import init as init_mod


class _Custom(nn.Module):
    """An init of every kind the recorder replays: trunc_normal_, pointwise ops, a copied constant."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.empty(64, 64))
        self.scaled = nn.Parameter(torch.empty(4096))
        self.const = nn.Parameter(torch.empty(3, 5))

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.t, mean=0.0, std=1.0, a=-1.0, b=1.5)
        nn.init.uniform_(self.scaled, -1.0, 1.0)
        self.scaled.data.mul_(3.0).add_(1.0)
        self.const.copy_(torch.arange(5.0))  # broadcast over the rows


def _model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(300, 16, padding_idx=7), nn.Linear(256, 128), nn.LayerNorm(16), _Custom())


def test_any_range_is_the_same_part_of_the_whole(monkeypatch) -> None:
    monkeypatch.setattr(init_mod, "BLOCK", 100)  # many blocks per parameter, ranges across their edges
    model = _model()
    source = er.init_weights(model, seed=3)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        whole = source.read(p, 0, p.numel())
        for _ in range(5):
            start = int(torch.randint(0, p.numel(), (), generator=gen))
            n = int(torch.randint(0, p.numel() - start + 1, (), generator=gen))
            assert torch.equal(source.read(p, start, n), whole[start : start + n]), name
    again = er.init_weights(_model(), seed=3)
    other = er.init_weights(_model(), seed=4)
    for p, q, r in zip(source.params, again.params, other.params):
        assert torch.equal(source.read(p, 0, p.numel()), again.read(q, 0, q.numel()))  # the seed decides
        if p.numel() > 100 and p.dim() > 1:
            assert not torch.equal(source.read(p, 0, p.numel()), other.read(r, 0, r.numel()))


def test_each_parameter_has_its_inits_distribution() -> None:
    model = _model()
    source = er.init_weights(model, seed=1)
    value = {name: source.read(p, 0, p.numel()).view(p.shape) for name, p in model.named_parameters()}
    emb = value["0.weight"]
    assert torch.all(emb[7] == 0) and abs(emb[:7].std().item() - 1.0) < 0.1  # N(0, 1), padding row 0
    bound = 1 / math.sqrt(256)  # kaiming_uniform_(a=sqrt(5)) and the bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    for name in ("1.weight", "1.bias"):
        v = value[name]
        assert v.abs().max().item() <= bound and v.min().item() < -0.9 * bound and v.max().item() > 0.9 * bound
    assert abs(value["1.weight"].std().item() - bound / math.sqrt(3)) < 0.03 * bound
    assert torch.all(value["2.weight"] == 1) and torch.all(value["2.bias"] == 0)
    t = value["3.t"]
    assert t.min().item() >= -1.0 and t.max().item() <= 1.5 and t.min().item() < -0.98 and t.max().item() > 1.45
    # a standard normal truncated to [-1, 1.5]: mean (phi(-1) - phi(1.5)) / Z
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: (1 + math.erf(x / math.sqrt(2))) / 2  # noqa: E731
    assert abs(t.mean().item() - (pdf(-1) - pdf(1.5)) / (cdf(1.5) - cdf(-1))) < 0.03
    scaled = value["3.scaled"]
    assert scaled.min().item() >= -2.0 and scaled.max().item() <= 4.0 and abs(scaled.mean().item() - 1.0) < 0.1
    assert torch.equal(value["3.const"], torch.arange(5.0).expand(3, 5))


def test_parameters_stay_on_meta_until_prepare() -> None:
    model = _model()
    er.init_weights(model)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"weights are still in the model's init"):
        model(torch.zeros(1, dtype=torch.long))


class _Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.w)


class _Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w)
        self.w.data.div_(self.w.data.norm())


class _Unset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))
        self.lin = nn.Linear(2, 2)


@pytest.mark.parametrize(
    "module, match",
    [
        (_Orthogonal, r"parameter '1\.w' \(8, 8\): the model's init applies aten\.copy_\.default .*orthogonal_"),
        (_Normalised, r"parameter '1\.w' \(8, 8\): the model's init applies aten\.linalg_vector_norm"),
        (_Unset, r"parameter '1\.w' \(8, 8\): the model's init does not set all of it \(0 of 64"),
    ],
)
def test_an_init_that_cannot_be_replayed_is_refused(module, match) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), module())
    with pytest.raises(er.InitError, match=match):
        er.init_weights(model)
    assert all(p.is_meta for p in model.parameters())  # the parameters are back, untouched
