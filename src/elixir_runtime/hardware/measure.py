"""Measures a ``HardwareProfile`` on this machine in a few seconds (≤ 15 s on a GPU host).

Each number is timed the way the engine will use it: pinned copies of the engine's own exact-size
page-locked arenas (``chunk/host_memory.py``), the engine's Adam kernels on arenas with the
engine's dtypes (bf16 gradient in, bf16 parameter out), matmuls and fused attention in the
compute dtype. Without a GPU the "device" is the host itself, which gives a valid profile for
planning a CPU run (and for tests), not a GPU prediction.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..chunk.collectives import Collectives
from ..chunk.host_memory import empty_host
from ..chunk.layout import GroupRange
from ..optim.kernel import AdamHyper, AdamKernel
from ..optim.select import select_kernel
from ..optim.threads import cpu_adam_threads, usable_cores
from ..host import host_total
from .profile import PROFILE_VERSION, HardwareProfile, LinkRates

__all__ = ["measure_hardware"]

_HYPER = [AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)]


def measure_hardware(*, quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> HardwareProfile:
    """``quick`` uses small sizes (a second or two, less exact): for tests and smoke runs."""
    start = time.perf_counter()
    profile = _measure_gpu(quick, dtype) if torch.cuda.is_available() else _measure_cpu(quick)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the measurement's buffers back before the plan counts free memory
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    profile.source = f"measured on {platform.node()} at {stamp} in {time.perf_counter() - start:.1f} s"
    profile.torch = torch.__version__
    profile.version = PROFILE_VERSION
    return profile


# ---------------------------------------------------------------------------------------- GPU


def _measure_gpu(quick: bool, dtype: torch.dtype) -> HardwareProfile:
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", 0)
    size = (64 if quick else 256) * 2**20
    links = _gpu_links(gpus, size)
    sizes = [512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192]
    cpu_adam, cpu_adam_alone = _cpu_adam_under_copies(links[gpus], 2**21 if quick else 2**25, dtype, size)
    return HardwareProfile(
        device=torch.cuda.get_device_name(dev),
        gpus=gpus,
        gpu_memory=torch.cuda.get_device_properties(dev).total_memory,
        host_memory=host_total(),
        cpu_cores=usable_cores(),
        matmul={str(s): _matmul_rate(s, dtype, dev) for s in sizes},
        attention=_attention_rate(dtype, dev, quick),
        memory_bandwidth=_copy_rate(dev, size * (1 if quick else 4)) * 2,
        op_overhead=_op_overhead(dev),
        gpu_adam=_adam_rate(dev, 2**22 if quick else 2**26, dtype),
        cpu_adam=cpu_adam,
        cpu_adam_alone=cpu_adam_alone,
        links=links,
        dtype=str(dtype).removeprefix("torch."),
    )


def _gpu_links(gpus: int, size: int) -> dict[int, LinkRates]:
    devs = [torch.device("cuda", i) for i in range(gpus)]
    dev_a = [torch.empty(size, dtype=torch.uint8, device=d) for d in devs]
    dev_b = [torch.empty(size, dtype=torch.uint8, device=d) for d in devs]
    host_a = [empty_host(size, torch.uint8, pin=True) for _ in devs]
    host_b = [empty_host(size, torch.uint8, pin=True) for _ in devs]
    up = [torch.cuda.Stream(d) for d in devs]
    down = [torch.cuda.Stream(d) for d in devs]

    def run(n: int, h2d: bool, d2h: bool, ring: bool = False) -> None:
        for i in range(n):
            if h2d:
                with torch.cuda.stream(up[i]):
                    dev_a[i].copy_(host_a[i], non_blocking=True)
            if d2h:
                with torch.cuda.stream(down[i]):
                    host_b[i].copy_(dev_b[i], non_blocking=True)
            if ring:
                with torch.cuda.stream(up[i]):
                    dev_a[(i + 1) % n].copy_(dev_b[i], non_blocking=True)
        for i in range(n):
            torch.cuda.synchronize(devs[i])

    def rate(n: int, **kinds: bool) -> float:
        return size / _median_time(lambda: run(n, **kinds), sync=lambda: None)

    links: dict[int, LinkRates] = {}
    for n in range(1, gpus + 1):
        links[n] = LinkRates(
            n,
            c2g=n * rate(n, h2d=True, d2h=False),
            g2c=n * rate(n, h2d=False, d2h=True),
            duplex=n * rate(n, h2d=True, d2h=True),
            g2g=rate(n, h2d=False, d2h=False, ring=True) if n > 1 else None,
        )
    return links


def _matmul_rate(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _median_time(lambda: a @ b, sync=lambda: _sync(device))


def _attention_rate(dtype: torch.dtype, device: torch.device, quick: bool) -> float:
    batch, heads, seq, dim = (1, 4, 256, 64) if quick or device.type == "cpu" else (8, 16, 1024, 128)
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    flops = 4 * batch * heads * seq * seq * dim // 2 * 7 // 2  # causal half; forward + 2.5x backward
    return flops / _median_time(step, sync=lambda: _sync(device))


def _copy_rate(device: torch.device, size: int) -> float:
    """Bytes copied per second by a large device-to-device (or host memcpy) copy."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return size / _median_time(lambda: dst.copy_(src), sync=lambda: _sync(device))


def _op_overhead(device: torch.device) -> float:
    x = torch.zeros(1, device=device)
    return _median_time(lambda: x.add_(1), sync=lambda: _sync(device), target=0.01)


def _adam_rate(device: torch.device, numel: int, dtype: torch.dtype) -> float:
    return numel / _adam_step(device, numel, dtype)[1]


def _adam_step(device: torch.device, numel: int, dtype: torch.dtype) -> tuple[Callable[[], None], float]:
    """One update of ``numel`` elements on ``device`` by the engine's kernel, and its time alone."""
    kernel = _kernel(device)
    alloc = (lambda n, dt: torch.zeros(n, dtype=dt, device=device)) if device.type == "cuda" else (
        lambda n, dt: empty_host(n, dt, pin=False).zero_()
    )
    master, m, v = alloc(numel, torch.float32), alloc(numel, torch.float32), alloc(numel, torch.float32)
    grad, out = alloc(numel, dtype), alloc(numel, dtype)
    segments, steps = [GroupRange(0, numel, 0)], iter(range(1, 10**6))

    def step() -> None:
        kernel.step(master, m, v, grad, out, segments, _HYPER, next(steps), 1.0)

    return step, _median_time(step, sync=lambda: _sync(device))


def _cpu_adam_under_copies(link: LinkRates, numel: int, dtype: torch.dtype, size: int) -> tuple[float, float]:
    """The CPU Adam rate while every GPU copies ``size`` bytes up and down, back to back, for
    longer than the timed updates take (queued first, so they run through the whole window);
    and the rate alone."""
    devs = [torch.device("cuda", i) for i in range(link.n)]
    ups, downs = [torch.cuda.Stream(d) for d in devs], [torch.cuda.Stream(d) for d in devs]
    bufs = [(torch.empty(size, dtype=torch.uint8, device=d), torch.empty(size, dtype=torch.uint8, device=d),
             empty_host(size, torch.uint8, pin=True), empty_host(size, torch.uint8, pin=True)) for d in devs]
    step, seconds = _adam_step(torch.device("cpu"), numel, dtype)
    calls = max(5, int(0.3 / seconds))
    per_copy = size / ((link.duplex or link.c2g) / link.n)
    for (dev_a, dev_b, host_a, host_b), up, down in zip(bufs, ups, downs):
        for _ in range(int(2 * calls * seconds / per_copy) + 2):
            with torch.cuda.stream(up):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(down):
                host_b.copy_(dev_b, non_blocking=True)
    time.sleep(per_copy)  # the copies are under way
    t = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = (time.perf_counter() - t) / calls
    for d in devs:
        torch.cuda.synchronize(d)
    return numel / elapsed, numel / seconds


def _kernel(device: torch.device) -> AdamKernel:
    # V_c is the whole host's rate (``Rates`` shares it among ranks) with the engine's threads,
    # not the OMP_NUM_THREADS=1 that torchrun gives each rank.
    return select_kernel(device, cpu_adam_threads(1) if device.type == "cpu" else None)


# ---------------------------------------------------------------------------------------- CPU


def _measure_cpu(quick: bool) -> HardwareProfile:
    cpu = torch.device("cpu")
    copy = _copy_rate(cpu, (16 if quick else 128) * 2**20)
    adam = _adam_rate(cpu, 2**20 if quick else 2**24, torch.bfloat16)
    host = host_total()
    return HardwareProfile(
        device="cpu",
        gpus=1,
        gpu_memory=host,
        host_memory=host,
        cpu_cores=usable_cores(),
        matmul={str(s): _matmul_rate(s, torch.float32, cpu) for s in ([128, 256] if quick else [256, 512, 1024])},
        attention=_attention_rate(torch.float32, cpu, quick),
        memory_bandwidth=copy * 2,
        op_overhead=_op_overhead(cpu),
        gpu_adam=adam,
        cpu_adam=adam,
        links={1: LinkRates(1, copy, copy)},
        dtype="float32",
    )


# ---------------------------------------------------------------------------------- collectives


def collective_busbw(coll: Collectives, device: torch.device, dtype: torch.dtype, nbytes: int = 64 * 2**20) -> float:
    """Bus bandwidth (bytes/s) of the engine's own all-gather + reduce-scatter of an ``nbytes``
    chunk on the job's process group (NCCL over the real topology on GPUs), the slowest rank's.
    Every rank of the group must call it."""
    n = coll.world_size
    elt = torch.empty((), dtype=dtype).element_size()
    full = torch.zeros(max(n, nbytes // elt // n * n), dtype=dtype, device=device)

    def both() -> None:
        coll.all_gather_(full)
        coll.reduce_scatter_avg_(full)

    both()  # the first collective sets the communicator up
    _sync(device)
    calls = 5
    start = time.perf_counter()
    for _ in range(calls):
        both()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=coll.group)
    return 2 * full.numel() * elt * (n - 1) / n / float(elapsed.item())


# ---------------------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], sync: Callable[[], None], target: float = 0.02) -> float:
    """Seconds per call of ``fn``: after a warm-up, three samples of as many back-to-back calls as
    fill ``target`` seconds (at most 200), the median."""
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    calls = int(min(200, max(1, target / max(time.perf_counter() - t, 1e-7))))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)
