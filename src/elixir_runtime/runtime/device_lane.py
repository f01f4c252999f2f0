"""The device lane: offloaded chunks updated by the GPU while the CPU updates others.

With clipping (the Trainer default) the CPU Adam of offloaded chunks starts only after the whole
backward, and while it runs the link and the GPU idle. This lane streams slices of an offloaded
shard through ``depth`` staging buffers on the GPU: the optimizer state (``adam_state.py``) and the gradient shard up (host to device),
the same kernel as on-device shards (``select.select_kernel``) with the same hyperparameters,
step counts and ``div_scale``, and the state and the compute-dtype param shard the gather
reads back down (the param only where the kernel wrote it), each buffer on its own stream, so
one slice's upload overlaps the previous one's download (bf16, exact moments: 14 bytes each way per
element; fp32: 16 up, 12 down). ``runtime/host_updates.py`` decides which slices it takes.

A staging buffer is ``numel`` elements of optimizer state and one compute-dtype tensor that
holds the gradient and then the new param (the kernel reads each element's gradient before it
writes its param): ``search.memory.staging_bytes``, counted in the plan's GPU memory. On a CPU
device (tests) the "GPU" is the CPU and the kernel the torch reference: the slicing, the
scheduling and the exactness are the same code.
"""

from __future__ import annotations

import contextlib

import torch

from ..adam_state import AdamState, AdamTensors
from ..chunk.layout import GroupRange
from ..kernels.kernel import AdamHyper, AdamKernel, TorchAdamKernel
from ..kernels.select import select_kernel
from .chunk_runtime import ChunkState
from .gradients import ChunkGradients
from .host_updates import SliceUpdate

__all__ = ["DeviceLane", "slice_updates", "LANE_SLICE", "LANE_DEPTH", "lane_numel"]

LANE_SLICE = 2**25
"""Elements per staging buffer of the lane (32 M): large enough that per-slice launches and host
syncs are noise beside the copies (docs/runtime.md)."""

LANE_DEPTH = 2
"""Staging buffers of the device lane (slices in flight): one uploading while the other downloads."""


def lane_numel(offloaded_shards: list[int]) -> int:
    """Elements per staging buffer for offloaded trainable shards of these sizes (0: none, no lane)."""
    return min(LANE_SLICE, max(offloaded_shards, default=0))


def slice_updates(
    c: ChunkState, work: list[tuple[int, list[GroupRange]]], hypers: list[AdamHyper], div_scale: float, size: int
) -> list[SliceUpdate]:
    """Chunk ``c``'s update cut into slices of at most ``size`` elements (each segment cut to
    them); slices with nothing to update are left out."""
    out = []
    for lo in range(c.offset, c.offset + c.shard_numel, max(1, size)):
        hi = min(lo + size, c.offset + c.shard_numel)
        cut = []
        for step, segments in work:
            parts = [
                GroupRange(max(s.offset, lo), min(s.offset + s.length, hi) - max(s.offset, lo), s.group)
                for s in segments
                if s.offset < hi and s.offset + s.length > lo
            ]
            if parts:
                cut.append((step, parts))
        if cut:
            out.append(SliceUpdate(c, lo, hi, cut, hypers, div_scale))
    return out


class DeviceLane:
    """Stages slices of offloaded shards on ``device``, updates them there, copies them back."""

    def __init__(self, numel: int, device: torch.device, dtype: torch.dtype, state: AdamState) -> None:
        self.numel, self.device, self.depth = numel, device, LANE_DEPTH
        self.cuda = device.type == "cuda"
        # one kernel per buffer: a fused kernel's cached tile tables are then made and used on that
        # buffer's stream only (a table uploaded on one stream and read on another could race)
        kind = type(select_kernel(device)) if self.cuda else TorchAdamKernel
        self._kernels: list[AdamKernel] = [kind() for _ in range(self.depth)]
        self._states = [
            AdamTensors(
                state, {t.kind: torch.zeros(t.entries(numel), dtype=t.dtype, device=device) for t in state.tensors}
            )
            for _ in range(self.depth)
        ]
        self._grads = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(self.depth)]
        self._streams = [torch.cuda.Stream(device) if self.cuda else None for _ in range(self.depth)]
        for stream in self._streams:
            if stream is not None:  # after the buffers' zero-fill
                stream.wait_stream(torch.cuda.current_stream(device))
        self._next = 0

    def issue(self, job: SliceUpdate) -> torch.cuda.Event | None:
        """Queues ``job``'s upload, update and download on the next buffer's stream; returns the
        event that says its results are in host memory (``None`` on a CPU device: done already)."""
        ChunkGradients.wait_host_chunk(job.chunk)  # its grads have landed, no gather reads it
        b = self._next
        self._next = (b + 1) % self.depth
        stream, a, n = self._streams[b], job.chunk.shards, job.numel
        with (
            torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext(),
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        ):
            host = a.state.range(job.lo, job.hi).tensors.values()
            staged = self._states[b].range(0, n)
            grad = self._grads[b][:n]
            for src, dst in zip(host, staged.tensors.values()):
                dst.copy_(src, non_blocking=True)
            grad.copy_(a.grad[job.lo : job.hi], non_blocking=True)
            out = None if a.master_is_param else grad  # each gradient is read before its param is written
            for step, segments in job.work:
                shifted = [GroupRange(s.offset - job.lo, s.length, s.group) for s in segments]
                self._kernels[b].step(staged, grad, out, shifted, job.hypers, step, job.div_scale)
            for dst, src in zip(host, staged.tensors.values()):
                dst.copy_(src, non_blocking=True)
            if out is not None:  # only where the kernel wrote params: elsewhere the buffer holds gradients
                for lo, hi in _covered(job.work):
                    a.param[lo:hi].copy_(out[lo - job.lo : hi - job.lo], non_blocking=True)
            if stream is None:
                return None
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def finish(token: torch.cuda.Event | None) -> None:
        if token is not None:
            token.synchronize()


def _covered(work: list[tuple[int, list[GroupRange]]]) -> list[tuple[int, int]]:
    """The arena ranges the kernel calls of ``work`` update, sorted, touching ones merged."""
    out: list[tuple[int, int]] = []
    for s in sorted((s for _, segments in work for s in segments), key=lambda s: s.offset):
        if out and s.offset <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], s.offset + s.length))
        else:
            out.append((s.offset, s.offset + s.length))
    return out
