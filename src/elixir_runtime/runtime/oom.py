"""A CUDA out-of-memory error in a planned run, told against the plan.

The error keeps its type (``torch.OutOfMemoryError``: what HF's and Accelerate's batch-size retries test for)
and message; a note (PEP 678) adds the plan's predicted GPU peak and its parts, what the allocator held at
the failure, and the ways out. The root's forward hook adds it to an error leaving the model's forward, the
optimizer's ``backward`` to one leaving the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PlannedMemory"]

GIB = 2**30


@dataclass(frozen=True)
class PlannedMemory:
    """What the plan predicted of the GPU (``ElixirPlan``'s memory, per rank)."""

    states: int
    """Model states, rCache and private buffers (``ElixirPlan.device_bytes``)."""
    activations: int | None
    """The profiled activation peak; ``None``: not profiled (a static plan)."""
    batch_shape: tuple[int, int] | None
    activations_where: str
    """``ElixirPlan.activations``."""

    def annotate(self, err: BaseException | None, where: str, device: torch.device) -> None:
        """Adds the note to ``err`` if it is a CUDA out-of-memory error not noted yet."""
        if not isinstance(err, torch.OutOfMemoryError) or any(
            "Elixir's plan" in n for n in getattr(err, "__notes__", ())
        ):
            return
        err.add_note(self.note(where, device))

    def note(self, where: str, device: torch.device) -> str:
        held = (
            f"the allocator held {torch.cuda.memory_reserved(device) / GIB:.2f} GiB "
            f"({torch.cuda.memory_allocated(device) / GIB:.2f} GiB in use, at most "
            f"{torch.cuda.max_memory_allocated(device) / GIB:.2f} since the last reset)"
            if device.type == "cuda"
            else "no CUDA device"
        )
        if self.activations is None:
            planned = f"{self.states / GIB:.2f} GiB of model states and cache, activations not profiled (a static plan)"
        else:
            shape = f" of a {self.batch_shape[0]} x {self.batch_shape[1]} batch" if self.batch_shape else ""
            planned = (
                f"a peak of {(self.states + self.activations) / GIB:.2f} GiB: {self.states / GIB:.2f} of model states "
                f"and cache + {self.activations / GIB:.2f} of activations{shape} (held block inputs on the "
                f"{self.activations_where})"
            )
        fixes = [
            "cap the GPU memory the plan may use below the card's, leaving room for what it did not foresee "
            '(--elixir \'{"gpu_memory": "120GiB"}\')',
            "train shorter sequences or smaller batches than the plan's",
        ]
        if self.activations_where == "device":
            fixes.append('keep the held block inputs in host memory (--elixir \'{"activations": "host"}\')')
        fixes.append('store Adam\'s moments in 8 bits (--elixir \'{"moments": "8bit"}\'), or offload more chunks')
        return (
            f"Elixir's plan, out of GPU memory in the {where}: the plan predicted {planned}; at the failure {held}. "
            "Ways out: "
            + "; ".join(fixes)
            + ". PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation."
        )
