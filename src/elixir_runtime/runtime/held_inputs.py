"""The held block inputs of a training forward in host memory, between their block's forward and its recompute.

[Note: held inputs] Under activation checkpointing a block keeps nothing for its backward but its
inputs, which its recompute reads. ``torch.utils.checkpoint`` saves its tensor arguments through the
saved-tensor hooks in force outside the region, the root's (``hooks.py``): the hidden states one block
hands the next, the *held block inputs*, one per block alive on the GPU at the loss, ``batch x seq x
hidden`` each, which is what limits the longest sequence. Where the checkpoint sits decides what the
pack hook sees: transformers 5.17 checkpoints a layer's call, so the save comes before the unit's
forward hooks, of the tensor the last unit returned; later versions checkpoint its ``forward``, so the
save comes just inside the unit's call, of the input its pre-forward hook handed on. Both are held
inputs here (``pack``). With the plan's activations on the host (``ElixirPlan.activations``):

* forward: the root's pack hook takes such a tensor, copies it into a pinned host buffer on the copy
  stream (after the compute stream's work so far) and lets the GPU tensor go; the allocator keeps its
  memory until the copy is done (``record_stream``). A unit that is not checkpointed saves its input
  the same way and gets the same round trip, correct and small. A reentrant checkpoint on 5.17 runs
  the unit's hooks without grad and hands the block a tensor no hook saw: only the first block's input
  goes (the profiler counts as much, so the plan is still true);
* backward: every unit's pre-backward brings back the newest ``LOOKAHEAD`` held inputs not yet on
  their way, so a block's input is on the GPU before its recompute asks for it; the unpack makes the
  compute stream wait for that copy (or copies then, if none ran ahead).

Every copy runs on the one copy stream, in order: a pinned buffer may take the next copy as soon as
its copy back is queued, with no event or host sync. A handle that dies unread (a forward whose
backward never ran) gives its buffer back the same way. On a CPU device the copies are plain host
copies: nothing is saved, but the path is the same (the tests run it there).

The profiler counts the same tensors (``profiler/hooks.py``: a checkpointed call's arguments that a
unit returned) and prices the GPU memory this leaves: the rest of the activations plus
``LOOKAHEAD + 1`` held inputs (the one in use and those coming back).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ..chunk.host_memory import empty_host

__all__ = ["HeldInput", "HeldInputs", "LOOKAHEAD"]

LOOKAHEAD = 2
"""Held inputs on their way back to the GPU ahead of the block being recomputed."""


class HeldInput:
    """One held input: its pinned copy and, once fetched, its GPU copy on the way back."""

    __slots__ = ("__weakref__", "buffer", "device", "dtype", "gpu", "host", "ready", "shape")

    def __init__(self, t: torch.Tensor, buffer: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.buffer = buffer
        self.host = buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.gpu: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        """Recorded on the copy stream after the copy back (CUDA only)."""


class HeldInputs:
    """The held inputs of the forwards whose backward has not run yet, newest last."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.inside = 0
        """Units inside their forward now."""
        self.last: Sequence[torch.Tensor] = ()
        """What the last unit to finish its forward returned (its tensors that need grad)."""
        self.entering: Sequence[torch.Tensor] = ()
        """What the pre-forward of the unit now inside its forward handed it (its tensors that need grad)."""
        self.held: list[weakref.ref[HeldInput]] = []
        self.free: list[torch.Tensor] = []
        """Pinned buffers (flat bytes) no held input uses, largest first."""
        self.bytes_out = 0
        """Bytes sent to the host since the engine started (``EngineStats``)."""

    # -- forward
    def begin_forward(self) -> None:
        self.inside, self.last, self.entering = 0, (), ()

    def enter(self, inputs: Sequence[torch.Tensor]) -> None:
        self.inside += 1
        self.entering = inputs

    def leave(self, outputs: Sequence[torch.Tensor]) -> None:
        self.inside -= 1
        self.last, self.entering = outputs, ()

    def end_forward(self) -> None:
        self.last = self.entering = ()  # the model's now: no reference of ours keeps them on the GPU

    def pack(self, t: torch.Tensor) -> HeldInput | None:
        """``t``'s handle if it is a held input (Note: held inputs), its copy to the host queued; else None:
        saved between units, a tensor the last unit returned; inside one unit, a tensor it was handed."""
        candidates = self.last if self.inside == 0 else self.entering if self.inside == 1 else ()
        if t.device != self.device or not any(t is c for c in candidates):
            return None
        h = HeldInput(t, self._buffer(t.numel() * t.element_size()))
        weakref.finalize(h, self._give_back, h.buffer)
        src = t.detach()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                h.host.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
        else:
            h.host.copy_(src)
        self.held.append(weakref.ref(h))
        self.bytes_out += t.numel() * t.element_size()
        return h

    # -- backward
    def prefetch(self) -> None:
        """Starts bringing back the newest ``LOOKAHEAD`` held inputs still on the host (a unit's pre-backward)."""
        self.held = [r for r in self.held if r() is not None]
        for ref in self.held[-LOOKAHEAD:]:
            h = ref()
            if h is not None and h.gpu is None:
                self._fetch(h)

    def unpack(self, h: HeldInput) -> torch.Tensor:
        if h.gpu is None:
            self._fetch(h)
        gpu = h.gpu
        assert gpu is not None, "fetched above"
        if h.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(h.ready)
        h.gpu, h.ready = None, None  # the recompute's now; a second backward through it fetches again
        self.held = [r for r in self.held if r() is not None and r() is not h]
        return gpu

    def _fetch(self, h: HeldInput) -> None:
        gpu = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                gpu.copy_(h.host, non_blocking=True)
                h.ready = torch.cuda.Event()
                h.ready.record()
            gpu.record_stream(self.stream)
        else:
            gpu.copy_(h.host)
        h.gpu = gpu

    # -- the pinned buffers
    def _buffer(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self.free if b.numel() >= nbytes]
        if fits:
            best = min(fits, key=torch.Tensor.numel)
            self.free.remove(best)
            return best
        return empty_host(nbytes, torch.uint8, pin=self.stream is not None)

    def _give_back(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)
        self.free.sort(key=torch.Tensor.numel, reverse=True)

    def release(self) -> None:
        """Lets every pinned buffer go (``elixir_runtime.release``)."""
        self.free.clear()
        self.held.clear()
