"""Random init in place: a meta model's own init, replayed on each rank's ranges on the compute device.

``init_weights(model)`` records what the model's init does to each parameter on meta (no memory)
and attaches it to the model (``attached.py``); ``prepare`` then draws each rank's shard ranges
on the compute device, a block at a time: no rank holds the model, nothing is broadcast.

[Note: recording the init]
The init (``init``: by default every module's ``reset_parameters``; ``elixir_hf`` passes
transformers' ``initialize_weights``) runs once on fake stand-ins of the meta parameters (fake
tensors on the CPU: no memory, and not ``meta``, for which ``torch.nn.init`` returns early) under
a ``TorchDispatchMode`` that turns every aten op on a parameter's storage into an ``_Op`` on a flat
range of it: draws (``normal_``, ``uniform_``, and ``torch.nn.init.trunc_normal_`` taken whole, as
its rejection sampling reads the values), writes (``zero_``, ``fill_``, ``copy_`` of a constant
tensor) and pointwise in-place ops with scalar arguments (``mul_``, ``add_``, ``clamp_``, ...). A
view is followed through its storage offset: a contiguous one is a flat range (``weight[pad]``),
a strided one is allowed only over the whole parameter and for order-free ops. Anything else
that touches a parameter (an op reading its values: a norm, ``orthogonal_``'s QR, a copy from a
computed tensor) raises ``InitError`` naming the parameter and the op, as does a parameter the
init leaves partly unwritten. Ops a later write of the whole parameter overwrites are dropped.

[Note: draws independent of the layout]
A draw over a range of ``n`` elements is cut into blocks of ``BLOCK`` elements from the range's
start; block ``k`` is always drawn whole, by a generator seeded with a hash of (seed, parameter
index, op index, ``k``), and a rank slices the part its shard needs. A parameter's values thus
depend on the seed and the model only, not on the chunk size, the rank count or which rank
draws: the same seed gives bitwise the same weights at any rank count and chunk size on one kind
of device (CPU and CUDA generators draw differently). The values are the init's distribution per
parameter, not bitwise what the init would draw from torch's global generator.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import torch
from torch import nn
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.types import Number
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from .attached import attach_weights

__all__ = ["BLOCK", "InitError", "InitWeights", "init_weights"]

BLOCK = 1 << 20
"""Elements per independently seeded draw (Note: draws independent of the layout)."""

FALLBACK = (
    'elixir_hf.from_config(..., init="rank0") (rank 0 initialises the whole model), or initialise it on rank 0 '
    "yourself and leave the other ranks on meta"
)


class InitError(ValueError):
    """A model init that cannot be replayed a range at a time (Note: recording the init)."""


@dataclass(frozen=True)
class _Op:
    """One recorded op on the flat range ``[start, stop)`` of a parameter."""

    start: int
    stop: int
    kind: str
    """``normal``, ``uniform``, ``trunc_normal`` (draws), ``fill``, ``copy`` (writes), ``pointwise``."""
    args: tuple[object, ...] = ()
    """After the tensor: a draw's floats, a fill's scalar, a ``pointwise`` op's constants."""
    func: OpOverloadPacket[..., object] | None = None
    """The aten op of a ``pointwise`` op (``args``, ``kwargs`` after the tensor)."""
    kwargs: tuple[tuple[str, object], ...] = ()
    value: torch.Tensor | None = None
    """The flat constant of a ``copy``, in the parameter's dtype, on the CPU."""

    @property
    def writes(self) -> bool:
        return self.kind != "pointwise"

    def apply(self, out: torch.Tensor, lo: int, hi: int, key: tuple[int, ...], gen: torch.Generator) -> None:
        """Applies the op to ``out``: the parameter's flat elements ``[lo, hi)``, inside the op's range."""
        if self.kind == "fill":
            out.fill_(cast(Number | complex, self.args[0]))  # _Recorder.record: zero_'s 0.0, fill_'s scalar
        elif self.kind == "copy":
            assert self.value is not None, "a copy carries its constant"
            out.copy_(self.value[lo - self.start : hi - self.start])
        elif self.kind == "pointwise":
            assert self.func is not None, "a pointwise op carries its aten op"
            self.func(out, *self.args, **dict(self.kwargs))
        else:
            args = cast(tuple[float, ...], self.args)  # _Recorder.record: a draw's arguments as floats
            for k in range((lo - self.start) // BLOCK, (hi - 1 - self.start) // BLOCK + 1):
                b0 = self.start + k * BLOCK
                b1 = min(b0 + BLOCK, self.stop)
                gen.manual_seed(_block_seed((*key, k)))
                block = _draw(self.kind, args, b1 - b0, out.dtype, out.device, gen)
                a, b = max(b0, lo), min(b1, hi)
                out[a - lo : b - lo].copy_(block[a - b0 : b - b0])


def _block_seed(key: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}Q", *key), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _draw(
    kind: str, args: tuple[float, ...], n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    if kind == "normal":
        return torch.empty(n, dtype=dtype, device=device).normal_(*args, generator=gen)
    if kind == "uniform":
        return torch.empty(n, dtype=dtype, device=device).uniform_(*args, generator=gen)
    # trunc_normal: the inverse CDF of a uniform draw between the bounds' CDFs, in fp32
    mean, std, a, b = args
    cdf = [(1.0 + math.erf((x - mean) / std / math.sqrt(2.0))) / 2.0 for x in (a, b)]
    u = torch.empty(n, dtype=torch.float32, device=device).uniform_(2 * cdf[0] - 1, 2 * cdf[1] - 1, generator=gen)
    return u.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b).to(dtype)


@dataclass(eq=False)
class InitWeights:
    """A meta model's init as recorded ops per parameter (an ``attached.AttachedWeights``)."""

    seed: int
    ops: dict[int, tuple[int, list[_Op]]]
    """``id(param)`` → (its index in the model, its ops in order)."""
    params: list[nn.Parameter]
    """The parameters ``ops`` is keyed by (kept so their ids stay theirs)."""
    guard: RemovableHandle | None = None
    fallback: str = FALLBACK
    _gens: dict[torch.device, torch.Generator] = field(default_factory=dict)

    @property
    def origin(self) -> str:
        return f"the model's init (seed {self.seed})"

    def covers(self, p: torch.Tensor) -> bool:
        return id(p) in self.ops

    def check(self) -> str | None:
        return None

    def agreement(self) -> object:
        return self.seed

    @torch.no_grad()
    def read(self, p: torch.Tensor, start: int, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of ``p``'s init, drawn on ``device`` (default: the
        CPU) in ``p``'s dtype; temporary memory: one block."""
        device = torch.device(device or "cpu")
        out = torch.empty(numel, dtype=p.dtype, device=device)
        index, ops = self.ops[id(p)]
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device)
        for k, op in enumerate(ops):
            lo, hi = max(op.start, start), min(op.stop, start + numel)
            if lo < hi:
                op.apply(out[lo - start : hi - start], lo, hi, (self.seed, index, k), gen)
        return out

    def close(self) -> None:
        self._gens.clear()


def init_weights(model: nn.Module, init: Callable[[], object] | None = None, seed: int | None = None) -> InitWeights:
    """Records ``init``'s effect on ``model``'s meta parameters and attaches it for ``prepare``.

    ``init``: what initialises the model (default: ``reset_parameters()`` of every module that
    has one). ``seed``: of the draws (default: drawn from torch's global generator, so
    ``torch.manual_seed``/``transformers.set_seed`` decide it; every rank must get the same).
    Buffers are not touched: build the model with them (parameters only on meta, e.g.
    ``accelerate.init_empty_weights()``). Raises ``InitError`` naming the parameter and the op
    the init applies that cannot be replayed on a range (Note: recording the init).
    """
    if init is None:
        init = _reset_parameters(model)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    params: dict[int, nn.Parameter] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in params:
            params[id(p)], names[id(p)] = p, name
    if not params:
        raise InitError(f"{type(model).__name__} has no parameter on the meta device: there is nothing to initialise")
    recorder = _Recorder()
    with _fakes(model, params) as fakes:
        for index, (pid, fake) in enumerate(fakes.items()):
            recorder.track(fake, index, names[pid])
        with torch.no_grad(), _trunc_normal_taken_whole(recorder), recorder:
            init()
    ops: dict[int, tuple[int, list[_Op]]] = {}
    for index, (pid, p) in enumerate(params.items()):
        written = recorder.written[index]
        if not _covers(written, 0, p.numel()):
            raise InitError(
                f"parameter {names[pid]!r} {tuple(p.shape)}: the model's init does not set all of it ("
                f"{sum(b - a for a, b in written)} of {p.numel()} elements): give it an init (transformers' "
                f"_init_weights, a module's reset_parameters), or build the model with its values: {FALLBACK}"
            )
        ops[pid] = (index, recorder.ops[index])
    source = InitWeights(seed & (2**63 - 1), ops, list(params.values()))
    attach_weights(model, source)
    return source


def _reset_parameters(model: nn.Module) -> Callable[[], None]:
    """The default init: every module's ``reset_parameters``."""

    def reset() -> None:
        for m in model.modules():
            reset_parameters = getattr(m, "reset_parameters", None)
            if callable(reset_parameters):
                reset_parameters()

    return reset


@contextlib.contextmanager
def _fakes(model: nn.Module, params: dict[int, nn.Parameter]) -> Iterator[dict[int, torch.Tensor]]:
    """The meta parameters swapped for fake CPU tensors of their shape and dtype (tied ones share one), restored after."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = {pid: torch.empty(p.shape, dtype=p.dtype) for pid, p in params.items()}
    swapped: list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter]] = []
    try:
        for m in model.modules():
            for key, p in list(m._parameters.items()):
                if p is not None and id(p) in fakes:
                    swapped.append((m._parameters, key, p))
                    m._parameters[key] = cast(nn.Parameter, fakes[id(p)])  # a fake stands in while the init runs
        yield fakes
    finally:
        for table, key, p in swapped:
            table[key] = p


_DRAWS = {"normal_": "normal", "uniform_": "uniform"}
_POINTWISE = frozenset(
    {"mul_", "div_", "add_", "sub_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "neg_", "abs_", "exp_"}
)
_SHAPE_ONLY = frozenset(
    {"empty_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like"}
)
"""Ops that read a parameter's shape and dtype only."""


class _Recorder(TorchDispatchMode):
    """Records ops on the tracked parameters' storages as ``_Op``s (Note: recording the init)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.index: dict[int, tuple[int, str, torch.Tensor]] = {}
        self.ops: list[list[_Op]] = []
        self.written: list[list[tuple[int, int]]] = []

    def track(self, fake: torch.Tensor, index: int, name: str) -> None:
        self.index[_storage(fake)] = (index, name, fake)
        self.ops.append([])
        self.written.append([])

    def __torch_dispatch__(
        self,
        func: OpOverload[..., object],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        touched = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _storage(t) in self.index]
        if not touched:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        only_target = all(t is target for t in touched)
        if func.namespace == "prim" or (only_target and (func.is_view or name in _SHAPE_ONLY)):
            return func(*args, **kwargs)
        if not only_target:
            self._refuse(touched[-1], func, "it reads the parameter's values")
        assert target is not None, "every touched tensor is the target, and one is"
        if name in _DRAWS or name in ("zero_", "fill_", "copy_") or name in _POINTWISE:
            self.record(target, func, name, args[1:], kwargs)
            return func(*args, **kwargs)
        self._refuse(target, func, "it reads or rearranges the parameter's values")

    def record(
        self, t: torch.Tensor, func: OpOverload[..., object], name: str, rest: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        index, _, base = self.index[_storage(t)]
        start, stop = self._range(t, base, func, order_free=name != "copy_")
        if name in _DRAWS:  # a generator the init passes is left out: the draws are ours either way
            op = _Op(start, stop, _DRAWS[name], tuple(float(a) for a in rest))
        elif name == "zero_":
            op = _Op(start, stop, "fill", (0.0,))
        elif name == "fill_":
            op = _Op(start, stop, "fill", (self._scalar(t, func, rest[0]),))
        elif name == "copy_":
            src = rest[0]
            if isinstance(src, FakeTensor) or src.is_meta:
                self._refuse(t, func, "it copies a computed tensor into the parameter (e.g. orthogonal_)")
            value = src.detach().to(dtype=t.dtype, device="cpu").expand(t.shape).contiguous().reshape(-1).clone()
            op = _Op(start, stop, "copy", value=value)
        else:
            scalars = tuple(self._scalar(t, func, a) for a in rest)
            if not _covers(self.written[index], start, stop):
                self._refuse(t, func, "it changes values the init has not set")
            kw = tuple((k, self._scalar(t, func, v)) for k, v in kwargs.items())
            op = _Op(start, stop, "pointwise", scalars, func.overloadpacket, kw)
        self.add(index, op, base.numel())

    def add(self, index: int, op: _Op, numel: int) -> None:
        if op.writes and (op.start, op.stop) == (0, numel):
            self.ops[index], self.written[index] = [], []
        self.ops[index].append(op)
        if op.writes:
            self.written[index].append((op.start, op.stop))

    def _range(self, t: torch.Tensor, base: torch.Tensor, func: object, order_free: bool) -> tuple[int, int]:
        """The flat range of the parameter that ``t`` (a view of it) covers."""
        start = cast(int, t.storage_offset() - base.storage_offset())  # fake tensors of concrete shapes
        if t.is_contiguous():
            return start, start + t.numel()
        if order_free and t.numel() == base.numel():
            return 0, base.numel()
        self._refuse(t, func, "it writes a strided part of the parameter")

    def _scalar(self, t: torch.Tensor, func: object, a: object) -> object:
        if isinstance(a, torch.Tensor):
            if isinstance(a, FakeTensor) or a.is_meta or a.numel() != 1:
                self._refuse(t, func, "its argument is a computed tensor, not a constant")
            return a.item()
        return a

    def _refuse(self, t: torch.Tensor, func: object, why: str) -> NoReturn:
        _, name, base = self.index[_storage(t)]
        raise InitError(
            f"parameter {name!r} {tuple(base.shape)}: the model's init applies {func} to it, which cannot be "
            f"replayed a range at a time on each rank ({why}); build the model with its values instead: {FALLBACK}"
        )


@contextlib.contextmanager
def _trunc_normal_taken_whole(recorder: _Recorder) -> Iterator[None]:
    """``torch.nn.init.trunc_normal_`` on a parameter recorded as one draw (its sampling reads values)."""
    stock = torch.nn.init._no_grad_trunc_normal_

    def trunc_normal(
        tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if _storage(tensor) not in recorder.index:
            return stock(tensor, mean, std, a, b, generator)
        index, _, base = recorder.index[_storage(tensor)]
        start, stop = recorder._range(tensor, base, "torch.nn.init.trunc_normal_", order_free=True)
        recorder.add(
            index, _Op(start, stop, "trunc_normal", (float(mean), float(std), float(a), float(b))), base.numel()
        )
        return tensor

    torch.nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = stock


def _storage(t: torch.Tensor) -> int:
    cdata: int = t.untyped_storage()._cdata  # the storage's C++ address
    return cdata


def _covers(intervals: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether the union of ``intervals`` covers ``[lo, hi)``."""
    at = lo
    for a, b in sorted(intervals):
        if a > at:
            break
        at = max(at, b)
    return at >= hi
