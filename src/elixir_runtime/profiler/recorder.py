"""The dispatch mode that watches every aten op of the traced step.

Memory is counted per *storage*, the unit the CUDA caching allocator hands out: a storage is
counted when an op first returns a tensor on it and released when its last reference dies
(a weak reference on the storage object, which torch keeps alive exactly as long as the storage).
So views cost nothing, tensors saved for backward stay counted until autograd drops them, and
activation-checkpoint recomputation allocates and frees like the real run. Storages that exist
before the step (parameters, buffers, the batch) are not activations and are never counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_leaves

from ..hardware.costs import op_cost
from .kernels import workspace_bytes
from .timeline import Timeline

__all__ = ["Recorder"]


class Recorder(TorchDispatchMode):
    def __init__(self, timeline: Timeline, param_names: dict[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.timeline = timeline
        self.param_names = param_names
        """``id`` of each (fake) parameter tensor → its canonical name."""
        self._storages: dict[int, int] = {}
        self._held: set[int] = set()
        self._closed = False

    def preexisting(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._storages[t.untyped_storage()._cdata] = 0

    def close(self) -> None:
        """Stops accounting: storages still alive after the step free nothing into the timeline."""
        self._closed = True

    def __torch_dispatch__(
        self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = arg_tree_leaves(*args, **kwargs)
        outputs = tree_leaves(out)
        tl = self.timeline
        for t in inputs:
            name = self.param_names.get(id(t))
            if name is not None:
                tl.use_param(name)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                self._track(t)
        if scratch := workspace_bytes(func, args):
            tl.alloc(scratch)  # beside the outputs, for the length of the call
            tl.free(scratch)
        tl.add_cost(*op_cost(func, args, kwargs, inputs, outputs))
        return out

    def hold(self, t: torch.Tensor) -> None:
        """``t``'s storage is a held block input (``runtime/held_inputs.py``) from now until it dies."""
        key = t.untyped_storage()._cdata
        if key in self._storages and key not in self._held and self._storages[key]:
            self._held.add(key)
            self.timeline.hold(self._storages[key])

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        self._storages[key] = nbytes
        self.timeline.alloc(nbytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        nbytes = self._storages.pop(key, 0)
        held = key in self._held
        self._held.discard(key)
        if not self._closed:
            self.timeline.free(nbytes, held)
