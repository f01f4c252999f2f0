"""Module and autograd hooks that tell the chunk runtime when each unit needs its chunks.

Per unit (FSDP2 style, no per-op interception):

* pre-forward: acquire + pin its chunks; wrap its grad-requiring inputs so that the backward
  through them (= the unit's backward is done) unpins the chunks again (post-backward);
* post-forward: unpin; hook the outputs so that the first gradient reaching them (= the unit's
  backward is about to start) re-acquires and pins the chunks (pre-backward).

[Note: saved tensors] Autograd saves views of parameters (``weight.t()`` for a matmul). Outside
activation-checkpointed regions the root installs saved-tensor hooks that store such a view as
(chunk, offset, size, stride) and rebuild it from wherever the chunk lives when backward needs it,
so a chunk may be evicted between forward and backward. Inside a checkpointed region, saved
tensors are recomputed in backward while the unit is pinned (from pre-backward to post-backward),
which is why the rCache can never be smaller than the largest unit.

The root's pre-forward first checks in with the other ranks (``lockstep.py``: a forward on some
ranks only fails everywhere, naming it), then acquires the root's chunks: the private chunks of
parameters read outside their module's call (``ParamTable.resident``, e.g. ``lm_head.weight`` under
TRL's fused LM head). Private chunks are never evicted, so each stays gathered from there until its
reduction in backward (or a step) releases it; the saved tensors of such a read are views of its
own buffer, left unpacked, and its gradient arrives through the usual post-accumulate-grad hook.
[Note: placeholder reads] The trace before the run finds the parameters a forward reads outside
their module (``profiler/outside.py``), but only on the path the example batch takes, and only with
one. So the first forward of each kind (training, no-grad, eval) runs under ``_PlaceholderReads``: an
aten op with a parameter that is still a placeholder among its inputs raises, naming it and the fix,
before any step could train on it. Later forwards run unwatched (one Python call per op costs
nothing once; every step it would); ``ELIXIR_DEBUG_STATES=1`` watches them all. A watched forward runs
eagerly (``torch.compiler.set_stance("force_eager")``): dynamo does not compile under a dispatch mode,
and would mark the frames it met there never to be compiled again. Its backward runs eagerly too: a
checkpointed block recomputed there must save what its eager forward saved (transformers 5.17
checkpoints a layer's call, around the compiled forward). The eager window ends with that backward,
with the forward if it fails or runs without grad, or at the model's next forward (a forward whose
backward never came): a compiled run is never left eager.

A training forward's check-in carries its ``(batch, seq)``, and every rank's goes to the
``BatchGuard`` (``batch_guard.py``: a batch larger than the plan's runs where the plan's budget
provably holds it, else is refused on every rank before the forward; without a profiled budget,
warns once). Inside ``full_params`` every hook stands by: the parameters are
all on this rank and forwards run alone.

With the plan's activations on the host, the root's pack hook sends the held block inputs there and
each unit's pre-backward brings them back ahead of their recompute (``held_inputs.py``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ..distributed import heartbeat
from ..distributed.lockstep import Op
from ..units import Unit
from . import state
from .batch_guard import BatchGuard, BatchShapeError, token_shape
from .chunk_runtime import ChunkRuntime
from .held_inputs import HeldInput, HeldInputs
from .phase import Phase

__all__ = ["EngineHooks", "PlaceholderReadError", "install_hooks"]


class _CallbackCtx(Protocol):
    callback: Callable[[], None]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: _CallbackCtx, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: _CallbackCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.callback()
        return (None, *grads)


class _Packed:
    __slots__ = ("chunk", "offset", "size", "stride")

    def __init__(self, chunk: int, t: torch.Tensor) -> None:
        self.chunk, self.offset, self.size, self.stride = chunk, t.storage_offset(), t.size(), t.stride()


class _UnitHooks:
    def __init__(self, runtime: ChunkRuntime, chunks: tuple[int, ...], held: HeldInputs | None) -> None:
        self.runtime, self.chunks, self.held = runtime, chunks, held
        self.post_backward_armed = False
        self.bwd_pinned = False

    def pre_forward(
        self, _module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        if self.runtime.ctx.phase.full:
            return args, kwargs  # the parameters are all here
        self.runtime.gathers.acquire(self.chunks, pin=True)
        self.post_backward_armed = False
        if not torch.is_grad_enabled():
            return args, kwargs
        held = self.held if self.runtime.ctx.phase.now is Phase.FORWARD else None
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            if held is not None:
                held.enter(())
            return args, kwargs
        self.post_backward_armed = True
        wrapped: tuple[torch.Tensor, ...] = _PostBackward.apply(  # type: ignore[no-untyped-call]  # Function.apply: unannotated
            self.post_backward, *(flat[i] for i in where)
        )
        for i, t in zip(where, wrapped):
            flat[i] = t
        if held is not None:
            held.enter(wrapped)
        hooked: tuple[tuple[object, ...], dict[str, object]] = tree_unflatten(flat, spec)  # what was flattened
        return hooked

    def post_forward(self, _module: nn.Module, _args: object, _kwargs: object, output: object) -> None:
        if self.runtime.ctx.phase.full:
            return
        self.runtime.gathers.release(self.chunks)
        if not torch.is_grad_enabled():
            return
        self.runtime.grads.note_grad_forward()
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.held is not None and self.runtime.ctx.phase.now is Phase.FORWARD:
            self.held.leave(outs)
        if outs:
            pin = self.post_backward_armed
            torch.autograd.graph.register_multi_grad_hook(outs, lambda _g: self.pre_backward(pin), mode="any")

    def pre_backward(self, pin: bool) -> None:
        """Pins only calls whose post-backward will fire (their inputs need grad); a call without
        one just gets its chunks gathered, and saved-tensor/grad hooks re-fetch on demand."""
        self.runtime.grads.begin_backward()
        if self.held is not None:
            self.held.prefetch()
        if self.bwd_pinned:
            return
        self.runtime.gathers.acquire(self.chunks, pin=pin)
        self.bwd_pinned = pin

    def post_backward(self) -> None:
        if self.bwd_pinned:
            self.runtime.gathers.release(self.chunks)
            self.bwd_pinned = False


class PlaceholderReadError(RuntimeError):
    """A forward read a parameter outside its module's call, where the engine had not gathered it."""


def _is_placeholder(t: object, ptr: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.layout is torch.strided
        and t.device.type != "meta"
        and t.untyped_storage().data_ptr() == ptr
    )


class _PlaceholderReads(TorchDispatchMode):
    """Raises at an op reading a placeholder ([Note: placeholder reads])."""

    def __init__(self, runtime: ChunkRuntime) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.ptr = runtime.gathers.placeholder_ptr
        self.names = {id(p): names[0] for p, names in zip(runtime.layout.params, runtime.layout.names)}

    def __torch_dispatch__(
        self,
        func: OpOverload[..., object],
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        for t in arg_tree_leaves(*args, **kwargs):
            if _is_placeholder(t, self.ptr):
                name = self.names.get(id(t), "a parameter (a view of it)")
                raise PlaceholderReadError(
                    f"the forward read {name!r} ({func}) outside its module's call, where the engine does not gather "
                    "it, and the trace before the run did not see that read (no example batch, or a path that batch "
                    "did not take). Fix: pass it to elixir_runtime.prepare(..., resident=[...]), or call its module"
                )
        return func(*args, **kwargs)


class _RootHooks:
    """Iteration boundaries for the access schedule, and the saved-tensor hooks around forward."""

    def __init__(
        self,
        runtime: ChunkRuntime,
        model: nn.Module,
        chunks: tuple[int, ...] = (),
        guard: BatchGuard | None = None,
        held: HeldInputs | None = None,
    ) -> None:
        self.runtime, self.model, self.chunks = runtime, model, chunks
        self.guard = guard or BatchGuard(None)
        self.held = held
        self.depth = 0
        self.saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.watched: set[tuple[bool, bool]] = set()
        """The kinds of forward (grad enabled, training) already run under ``_PlaceholderReads``."""
        self.watch: _PlaceholderReads | None = None
        self.eager: AbstractContextManager[object] | None = None
        """``torch.compiler.set_stance("force_eager")``, entered for a watched forward and left after it, or
        after its backward: a checkpointed block recomputed there must run as its forward ran."""

    def pre_forward(self, _module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        phase = self.runtime.ctx.phase
        if phase.now is Phase.FULL_ELSEWHERE:
            raise RuntimeError(
                "full_params(rank0_only=True) gathered the parameters on rank 0 only: run this forward on rank 0 "
                "(`if rank == 0:` inside the context), or enter full_params() without rank0_only"
            )
        if phase.now is Phase.FULL:
            return
        grad = torch.is_grad_enabled()
        if self.depth == 0:  # every rank must be starting this forward too (distributed/lockstep.py)
            self.runtime.unpark()  # the parameters parked since the last step go back to the engine (full_params.park)
            training = grad and self.model.training and self.guard.planned is not None
            shape = token_shape(args, kwargs) if training else None
            shapes = self.runtime.ctx.lockstep.check_in(Op.TRAINING_FORWARD if grad else Op.NO_GRAD_FORWARD, shape)
            try:
                self.guard.check(shapes)  # every rank's shape: every rank decides alike
            except BatchShapeError:
                heartbeat.step_ended()  # refused on every rank: no step, nobody waits for anybody
                raise
        self.depth += 1
        if self.depth > 1:
            return
        phase.to(Phase.FORWARD)
        kind = (grad, self.model.training)
        self.runtime.gathers.schedule.begin(kind)
        if self.chunks:  # private: never evicted, so no pin is needed to keep them
            self.runtime.gathers.acquire(self.chunks, pin=False)
        self.end_eager()  # a new forward: the last one's backward ran, or never will
        if kind not in self.watched or state.CHECKING:
            self.watched.add(kind)
            self.eager = torch.compiler.set_stance("force_eager")
            self.eager.__enter__()
            self.watch = _PlaceholderReads(self.runtime)
            self.watch.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's, unannotated
        if grad:
            if self.held is not None:
                self.held.begin_forward()
            self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.saved_hooks.__enter__()

    def post_forward(self, _module: nn.Module, _args: object, output: object) -> None:
        ctx = self.runtime.ctx
        if output is None and ctx.memory is not None:  # failed: always_call runs it inside the forward's except
            ctx.memory.annotate(sys.exc_info()[1], "forward", ctx.device)
        if self.runtime.ctx.phase.full or self.depth == 0:  # depth 0: its pre-forward failed before counting it
            return
        self.depth -= 1
        if self.depth > 0:
            return
        self.runtime.ctx.phase.to(Phase.IDLE)
        if self.watch is not None:
            self.watch.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # as __enter__
            self.watch = None
            if output is None or not torch.is_grad_enabled():  # failed (always_call gives None), or no backward
                self.end_eager()  # else at the end of its backward (install_hooks)
        if self.saved_hooks is not None:
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None
            if self.held is not None:
                self.held.end_forward()

    def end_eager(self) -> None:
        if self.eager is not None:
            self.eager.__exit__(None, None, None)
            self.eager = None

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Packed | HeldInput:
        buffer = self.runtime.gathers.buffer_of(t)
        if buffer is None or buffer.chunk is None:
            held = self.held.pack(t) if self.held is not None else None
            return t if held is None else held
        return _Packed(buffer.chunk, t)

    def unpack(self, packed: torch.Tensor | _Packed | HeldInput) -> torch.Tensor:
        if isinstance(packed, HeldInput):
            assert self.held is not None, "packed by it"
            return self.held.unpack(packed)
        if not isinstance(packed, _Packed):
            return packed
        chunk = self.runtime.gathers.ensure_gathered(packed.chunk)
        assert chunk.buffer is not None, "a gathered chunk holds a buffer"
        return chunk.buffer.data.as_strided(packed.size, packed.stride, packed.offset)


class EngineHooks:
    """Every hook ``install_hooks`` put on a model: the units' module hooks (taken off while the
    parameters are parked, ``full_params.park``, and put back at the next forward), the root's, and the
    parameters' gradient hooks. ``remove`` takes all of them off (``elixir_runtime.release``)."""

    def __init__(self, model: nn.Module, units: list[tuple[nn.Module, _UnitHooks]], root: _RootHooks) -> None:
        self.model, self.units, self.root = model, units, root
        self._unit_handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []
        self._root_handles = [
            model.register_forward_pre_hook(root.pre_forward, prepend=True, with_kwargs=True),
            model.register_forward_hook(root.post_forward, always_call=True),
        ]
        self.attach_units()

    @property
    def units_attached(self) -> bool:
        return bool(self._unit_handles)

    def attach_units(self) -> None:
        """The units' module hooks and the parameters' gradient hooks, if they are off."""
        if self.units_attached:
            return
        for module, h in self.units:
            self._unit_handles.append(module.register_forward_pre_hook(h.pre_forward, with_kwargs=True))
            self._unit_handles.append(module.register_forward_hook(h.post_forward, with_kwargs=True, always_call=True))
        runtime = self.root.runtime
        # A tensor's grad hooks live in its C++ autograd meta, out of the garbage collector's sight: a
        # hook holding the runtime (which holds the params) would keep the engine, its pinned arenas
        # and its GPU memory alive after the model and optimizer are gone.
        weak = weakref.proxy(runtime)
        for i, p in enumerate(runtime.layout.params):
            if runtime.layout.groups[i] >= 0:
                self._grad_handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: weak.grads.on_grad(i, p)))

    def detach_units(self) -> None:
        """Takes the units' and the parameters' hooks off; the root's stay, to put them back."""
        for h in self._unit_handles + self._grad_handles:
            h.remove()
        self._unit_handles, self._grad_handles = [], []

    def remove(self) -> None:
        self.detach_units()
        for h in self._root_handles:
            h.remove()
        self._root_handles = []
        if self.root.held is not None:
            self.root.held.release()


def install_hooks(
    model: nn.Module,
    units: list[Unit],
    unit_chunks: Sequence[tuple[int, ...]],
    runtime: ChunkRuntime,
    guard: BatchGuard | None = None,
    held: HeldInputs | None = None,
) -> EngineHooks:
    """Installs every hook (``unit_chunks[i]``: the chunks unit ``i`` acquires; ``runtime.root_chunks``:
    the private ones every forward of ``model`` acquires first; ``guard``: ``ElixirPlan.batch_guard()``,
    which judges training batches larger than the plan's; ``held``: where the plan keeps activations on the
    host, what takes the held block inputs there)."""
    root_chunks = runtime.root_chunks
    hooked: list[tuple[nn.Module, _UnitHooks]] = []
    for unit, chunks in zip(units, unit_chunks, strict=True):
        h = _UnitHooks(runtime, chunks, held)
        hooked.append((unit.module, h))
        runtime.grads.on_finish_backward.append(h.post_backward)
    assert all(runtime.chunks[i].spec.private for i in root_chunks), "the root acquires private chunks only"
    root = _RootHooks(runtime, model, root_chunks, guard, held)
    runtime.grads.on_finish_backward.append(root.end_eager)
    return EngineHooks(model, hooked, root)
