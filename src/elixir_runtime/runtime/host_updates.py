"""CPU Adam of offloaded chunks on a worker thread, overlapped with the next forward.

Offloaded chunks are updated one by one in chunk (= next forward) order while the GPU already
runs the next forward over the first, GPU-resident chunks. A gather or a gradient reduction of an
offloaded chunk waits only for that chunk's own update. The C++ kernel releases the GIL (ctypes),
so the update and the training loop's Python run in parallel.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

__all__ = ["HostUpdates"]


class HostUpdates:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elixir-cpu-adam")
        self._pending: dict[int, Future] = {}

    def submit(self, chunk: int, update: Callable[[], None]) -> None:
        """Queues ``update`` for ``chunk``; updates run in submission order."""
        self._pending[chunk] = self._pool.submit(update)

    def busy(self, chunk: int) -> bool:
        """Whether ``chunk``'s update is queued or running (a prefetch should not block on it)."""
        future = self._pending.get(chunk)
        return future is not None and not future.done()

    def pending(self, chunk: int) -> bool:
        """Whether ``chunk`` has an update not yet waited for: unlike ``busy``, the same on every
        rank at the same point of the step (it does not depend on how fast the worker is)."""
        return chunk in self._pending

    def wait(self, chunk: int) -> None:
        """Blocks until ``chunk``'s update is done (re-raising its error, if any)."""
        future = self._pending.pop(chunk, None)
        if future is not None:
            future.result()

    def wait_all(self) -> None:
        for chunk in list(self._pending):
            self.wait(chunk)
