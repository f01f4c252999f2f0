"""Peak host memory of this process and of the whole host, sampled on a thread.

Reads /proc directly (psutil is not on every GPU image). The host-wide figure matters as much
as the process's: the offload baselines have been OOM-killed by the kernel, not by torch.
"""

from __future__ import annotations

import threading
from pathlib import Path

GIB = 2**30


def _kib_field(path: str, key: str) -> int | None:
    """Bytes of a ``Key:  N kB`` line of a /proc file, or None where it does not exist."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    return _kib_field("/proc/self/status", "VmRSS") or 0


def peak_rss_bytes() -> int:
    """The process's peak RSS since it started (the kernel's high-water mark)."""
    return _kib_field("/proc/self/status", "VmHWM") or 0


def host_used_bytes() -> int:
    total, avail = _kib_field("/proc/meminfo", "MemTotal"), _kib_field("/proc/meminfo", "MemAvailable")
    return (total - avail) if total is not None and avail is not None else 0


def host_total_bytes() -> int:
    return _kib_field("/proc/meminfo", "MemTotal") or 0


class HostMemorySampler:
    """Max RSS and max host-wide used memory since the last ``reset``; a daemon thread polls."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.peak_rss = 0
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-mem-sampler", daemon=True)

    def start(self) -> HostMemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        self.peak_rss, self.peak_used = rss_bytes(), host_used_bytes()

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, rss_bytes())
        self.peak_used = max(self.peak_used, host_used_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()
