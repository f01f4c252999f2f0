"""Running a model on fake tensors: no real memory, no real compute.

``fake_run`` is the one way in, for the profiler's training step and for ``trace_unit_order``'s
forward: the model in training mode, its own parameters and buffers swapped for fake ones (in the
compute dtype, on the compute device) and restored afterwards, whatever happens; tied parameters
stay tied (one fake per parameter object). Swapping in place, rather than
``torch.func.functional_call``, keeps the fakes in place through backward, where activation
checkpointing re-runs the forward. Custom (Triton) kernels are skipped and data-dependent scalars
answered with a constant (``launches.py``, [Note: kernels on fake tensors]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from .launches import Launch, skipped_launches

__all__ = ["FakeRun", "fake_run", "loss_of"]


@dataclass(frozen=True)
class FakeRun:
    """What ``fake_run`` swapped in."""

    params: dict[int, torch.Tensor]
    """``{id(real parameter): its fake}``; tied parameters share one."""
    buffers: list[torch.Tensor]
    """The fake buffers, one per buffer object."""
    batch: object
    """The batch's structure with every tensor a fake on the compute device."""


@contextlib.contextmanager
def fake_run(
    model: nn.Module, batch: object, dtype: torch.dtype | None, device: torch.device, on_launch: Launch | None = None
) -> Iterator[FakeRun]:
    """``model`` in training mode on fake parameters and buffers, inside a fake tensor mode in which
    0-dim ``torch.rand`` draws are constant, ``item()`` answers 1 and Triton launches on fakes are
    skipped (``on_launch`` is told of each); call ``model`` on the yielded ``FakeRun.batch``."""
    with (
        torch.compiler.set_stance("force_eager"),  # compiled code is not traced here (compile.py)
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        _ConstantItems(),  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        skipped_launches(on_launch),
        _fake_state(model, dtype, device) as (
            params,
            buffers,
        ),
        _train_mode(model),
        _constant_scalar_draws(mode),
    ):
        yield FakeRun(params, buffers, _fake_batch(batch, device))


@contextlib.contextmanager
def _fake_state(
    model: nn.Module, dtype: torch.dtype | None, device: torch.device
) -> Iterator[tuple[dict[int, torch.Tensor], list[torch.Tensor]]]:
    """Yields ``({id(real param): fake param}, fake buffers)``; call inside the fake mode.

    Floating-point parameters take ``dtype`` (the engine computes in it); buffers keep theirs.
    A fake parameter drops its gradient as soon as it is accumulated, as the engine does when it
    copies the gradient into its chunk.
    """
    fakes: dict[int, torch.Tensor] = {}
    buffers: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in fakes:
                    fakes[id(p)] = _fake_param(p, dtype, device)
                swapped.append((module._parameters, key, p))
                module._parameters[key] = fakes[id(p)]  # type: ignore[assignment]  # a fake tensor in its place
            for key, b in list(module._buffers.items()):
                if b is None:
                    continue
                if id(b) not in buffers:
                    buffers[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                swapped.append((module._buffers, key, b))
                module._buffers[key] = buffers[id(b)]
        yield fakes, list(buffers.values())
    finally:
        for table, key, original in swapped:
            table[key] = original


def _fake_param(p: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    floating = p.is_floating_point()
    fake = torch.empty(p.shape, dtype=dtype if floating and dtype is not None else p.dtype, device=device)
    if floating and p.requires_grad:
        fake.requires_grad_(True)
        fake.register_post_accumulate_grad_hook(_drop_grad)
    return fake


def _drop_grad(t: torch.Tensor) -> None:
    t.grad = None


def _fake_batch(batch: object, device: torch.device) -> object:
    """The batch's structure with every tensor replaced by a fake one on ``device``; a mapping that is
    not a dict (a collator's ``BatchEncoding``: pytree does not open it) becomes a dict."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    return tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t, batch
    )


def loss_of(output: object) -> torch.Tensor:
    """The scalar a training loop calls ``backward`` on: ``output.loss`` (HF, or any object with a
    ``loss``), ``output["loss"]``, or else the sum of every grad-requiring output."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        raise ValueError("the model's output holds no loss and no tensor that requires grad: nothing to backward")
    return cast(torch.Tensor, sum(t.float().sum() for t in outs))


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    """Training mode for the trace (dropout on, HF checkpointing active); each module's own flag
    is restored afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


_DATA_ANSWERS = {
    torch.ops.aten._local_scalar_dense.default: lambda t: 1.0 if t.is_floating_point() else 1,  # a count or sum
    torch.ops.aten.equal.default: lambda *_: True,  # torch.equal(grad_output, 1.0): the loss's own gradient
}
"""Data-dependent answers the fake mode cannot give, and what the trace takes instead. A truth value
(``if x.sum() > 0:``) is not answered: a branch on data has no right guess, and the trace fails."""


class _ConstantItems(TorchDispatchMode):
    """Answers the ops of ``_DATA_ANSWERS`` on fake tensors, which the fake mode would refuse: see
    [Note: kernels on fake tensors] in ``launches.py``."""

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        answer = _DATA_ANSWERS.get(func)
        if answer is not None and args[0].dtype is not torch.bool:
            return answer(*args)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _constant_scalar_draws(mode: FakeTensorMode) -> Iterator[None]:
    """Makes 0-dim ``torch.rand`` draws concrete (just below 1) while tracing in ``mode``.

    Some models branch on a random scalar, e.g. LayerDrop in transformers' OPT (5.17):
    ``if torch.rand([]) < self.layerdrop: continue``. Fake tensors cannot branch on data; a
    constant draw just below 1 drops no layer, which is also the step's memory-worst case.
    """
    real_rand = torch.rand

    def rand(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
        if len(shape) > 0:
            return real_rand(*size, **kwargs)
        with _disable_current_modes():
            value = torch.full((), 1.0 - 2**-20, dtype=kwargs.get("dtype") or torch.get_default_dtype())
        return mode.fake_tensor_converter.from_real_tensor(mode, value, make_constant=True)

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = real_rand
