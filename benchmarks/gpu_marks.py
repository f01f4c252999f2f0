"""CUDA events beside a step's host stamps: where the GPU was while the loop's thread waited (``benchmarks.step_anatomy``)."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["GpuMarks"]


class GpuMarks:
    """CUDA events on the loop's stream beside the host's stamps: at each step's start (the GPU idle)
    and loss, and just before and after each wait for an offloaded chunk's update (``HostUpdates.wait``,
    wrapped). The host runs ahead of the GPU: read after the step, the events give the GPU's own
    forward and where it was when the host waited for each chunk (its idle time is the engine's
    ``update_stall_s``); ``close`` unwraps it. Off the GPU (``device`` not CUDA) nothing is recorded."""

    def __init__(self, updates: Any, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.marks: list[tuple[str, int, float, Any]] = []
        """``(kind, chunk, host perf_counter, event)``: kinds ``start``, ``loss``, ``before``, ``after``."""
        self._updates = updates
        if self.on:
            wait = updates.wait

            def marked(chunk: int) -> None:
                self.mark("before", chunk)
                wait(chunk)
                self.mark("after", chunk)

            updates.wait = marked

    def close(self) -> None:
        """Gives the updates their own ``wait`` back (the marks recorded stay readable)."""
        if self.on:
            del self._updates.wait

    def mark(self, kind: str, chunk: int = -1) -> None:
        if self.on:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((kind, chunk, time.perf_counter(), event))

    def forward(self, t: dict[str, float]) -> dict[str, Any]:
        """The GPU's side of the step stamped ``t`` (after it ran): its forward, and each wait's chunk,
        host start and end and the GPU's position then (seconds since the start)."""
        if not self.on:
            return {"gpu_forward_s": None, "waits": []}
        rows = [m for m in self.marks if t["start"] <= m[2] <= t["loss"]]
        start = next(m for m in rows if m[0] == "start")
        loss = next(m for m in rows if m[0] == "loss")

        def gpu(m: tuple[str, int, float, Any]) -> float:
            return start[3].elapsed_time(m[3]) / 1e3

        waits, before = [], None
        for m in rows:
            if m[0] == "before":
                before = m
            elif m[0] == "after" and before is not None:
                waits.append(
                    {
                        "chunk": m[1],
                        "host_start": before[2] - t["start"],
                        "host_end": m[2] - t["start"],
                        "gpu_reached": gpu(before),
                    }
                )
        return {"gpu_forward_s": gpu(loss), "waits": waits}
