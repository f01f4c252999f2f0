"""Measures a ``HardwareProfile`` on this machine in seconds (plus a few per number of ranks whose
CPU Adam is measured by processes of its own).

Each number is timed the way the engine uses it: copies of the engine's own exact-size page-locked
arenas (``chunk/host_memory.py``), the engine's Adam kernels with its dtypes (bf16 gradient in,
bf16 parameter out), matmuls and fused attention in the compute dtype. Without a GPU the "device"
is the host: a valid profile for planning a CPU run (and for tests), never a GPU prediction.

[Note: CPU Adam per rank] The CPU Adam of n ranks sharing a host is timed as n ranks run it: n
processes at once (the job's own ranks at ``prepare``, or n spawned processes, one per GPU, for
``--measure-hardware``), each with the engine's threads for n ranks (``cpu_adam_threads(n)``), on
arenas it first touched itself (its NUMA node), while its own GPU copies up and down; the slowest
rank's rate counts. Why not one process divided by n: docs/planning.md, "Why per rank, measured
together"."""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..adam_state import ADAM_STATE, AdamState, AdamTensors
from ..chunk.host_memory import empty_host
from ..chunk.layout import GroupRange
from ..distributed.collectives import Collectives
from ..host import host_total, usable_cores
from ..kernels.kernel import AdamHyper
from ..kernels.quant8 import encode_state
from ..kernels.select import select_kernel
from ..kernels.threads import cpu_adam_threads
from ..progress import progress
from .costs import op_cost
from .profile import PROFILE_VERSION, CpuAdamRate, HardwareProfile, LinkRates, gemm_shape

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Barrier

__all__ = ["measure_hardware", "host_cpu_adam", "job_cpu_adam", "rank_cpu_adam", "rank_counts", "collective_busbw"]

_HYPER = [AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)]


def measure_hardware(
    *, quick: bool = False, dtype: torch.dtype = torch.bfloat16, ranks: Sequence[int] | None = None
) -> HardwareProfile:
    """``quick`` uses small sizes (a second or two, less exact): for tests and smoke runs. ``ranks``:
    the numbers of ranks sharing the host whose per-rank CPU Adam is measured (``host_cpu_adam``;
    default ``rank_counts()``; none: left to the job's ranks, ``job_cpu_adam``)."""
    start = time.perf_counter()
    counts = rank_counts() if ranks is None else ranks
    with progress(1 + len(counts), "elixir: measuring this machine") as bar:
        profile = _measure_gpu(quick, dtype) if torch.cuda.is_available() else _measure_cpu(quick)
        bar.update()
        for n in counts:
            for state in ADAM_STATE.values():
                profile.cpu_table(state)[n] = host_cpu_adam(n, quick=quick, dtype=dtype, state=state)
            bar.update()
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
    return HardwareProfile(
        device=torch.cuda.get_device_name(dev),
        gpus=gpus,
        gpu_memory=torch.cuda.get_device_properties(dev).total_memory,
        host_memory=host_total(),
        cpu_cores=usable_cores(),
        matmul={str(s): _gemm_rate(s, s, s, dtype, dev) for s in sizes},
        attention=_attention_rates(dtype, dev, quick),
        memory_bandwidth=_copy_rate(dev, size * (1 if quick else 4)) * 2,
        elementwise=_elementwise_rate(dtype, dev, quick),
        op_overhead=_op_overhead(dev),
        gpu_adam=_adam_rate(dev, 2**22 if quick else 2**26, dtype),
        gpu_adam8=_adam_rate(dev, 2**22 if quick else 2**26, dtype, state=ADAM_STATE["8bit"]),
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


def _gemm_rate(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    return 2 * m * n * k / _median_time(lambda: a @ b, sync=lambda: _sync(device))


def gemm_rates(classes: Iterable[str], dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """FLOP/s of each GEMM shape among ``classes`` (size classes, ``"8192x1024x4096"``) on ``device``, in
    the compute dtype; a shape whose operands and output would take over a quarter of the free
    memory is left out (priced by ``matmul``). The tensors are given back before returning."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_total()
    elt = torch.empty((), dtype=dtype).element_size()
    rates = {}
    for cls in sorted(classes):
        shape = gemm_shape(cls)
        if shape is None:
            continue
        m, n, k = shape
        if (m * k + k * n + m * n) * elt > free // 4:
            continue
        rates[cls] = _gemm_rate(m, n, k, dtype, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


def _attention_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict[str, float]:
    """FLOP/s of fused causal attention, forward and backward, by sequence length: 32 heads of 128
    and 16k tokens a call, as a 7-8B model's layer at batch 8 × 2048 (small shapes on the CPU or
    ``quick``), timed over 0.1 s windows.

    [Note: attention's shapes] The rate grows with the sequence (the kernels' tiles fill better:
    325 to 500 TFLOPS from 1024 to 8192 keys on an H200), so it is kept by length. Each call
    returns fresh gradients: an accumulating ``backward`` times three gradient adds with the
    kernels. One short seq-1024 window with accumulation read 104 TFLOPS on an H200 where the
    runs' steps imply about 400 (docs/planning.md, "Profiles for other cards")."""
    small = quick or device.type == "cpu"
    seqs, heads, dim, tokens = ((128, 256), 4, 64, 256) if small else ((1024, 2048, 4096, 8192), 32, 128, 2**14)
    return {str(seq): _attention_rate((tokens // seq, heads, seq, dim), dtype, device) for seq in seqs}


def _attention_rate(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> float:
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    batch, heads, seq, dim = shape
    flops = 4 * batch * heads * seq * seq * dim // 2 * 7 // 2  # causal half; forward + 2.5x backward
    return flops / _median_time(step, sync=lambda: _sync(device), target=0.1)


def _copy_rate(device: torch.device, size: int) -> float:
    """Bytes copied per second by a large device-to-device (or host memcpy) copy."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return size / _median_time(lambda: dst.copy_(src), sync=lambda: _sync(device))


def _elementwise_rate(dtype: torch.dtype, device: torch.device, quick: bool) -> float:
    """Bytes/s of a decoder block's memory-bound ops as transformers runs them eagerly (RMSNorm in
    fp32, rotary embedding's halves, SwiGLU, the residual add; forward and backward), bytes counted
    as the profiler counts them (``costs.op_cost``: each op's inputs and outputs). A 7-8B
    layer's shapes at 8k tokens (small ones on the CPU or ``quick``).

    [Note: memory-bound ops] Such ops move their bytes slower than a copy does: casts, reductions,
    broadcasts and strided halves. Priced at a copy's bandwidth, an eager step's were predicted well
    short of what ``benchmarks.compute_split`` measures (docs/planning.md, "The compute split")."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    small = quick or device.type == "cpu"
    tokens, heads, dim, ffn = (1024, 4, 64, 512) if small else (8192, 32, 128, 14336)
    hidden = heads * dim

    def new(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype).requires_grad_()

    x, weight, gate, up = new(tokens, hidden), new(hidden), new(tokens, ffn), new(tokens, ffn)
    cos, sin = (torch.randn(tokens, 1, dim, device=device).to(dtype) for _ in range(2))
    grads = (torch.randn_like(x), torch.randn_like(gate))

    def block() -> None:
        h = x.float()
        h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        q = h.view(tokens, heads, dim)
        rotated = torch.cat((-q[..., dim // 2 :], q[..., : dim // 2]), -1)
        out = x + (q * cos + rotated * sin).view(tokens, hidden)
        act = torch.nn.functional.silu(gate) * up
        torch.autograd.grad((out, act), (x, weight, gate, up), grads)

    class Bytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.moved = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.moved += op_cost(func, args, kwargs, tree_leaves((args, kwargs)), tree_leaves(out))[2]
            return out

    counted = Bytes()
    with counted:
        block()
    return counted.moved / _median_time(block, sync=lambda: _sync(device), target=0.1)


def _op_overhead(device: torch.device) -> float:
    x = torch.zeros(1, device=device)
    return _median_time(lambda: x.add_(1), sync=lambda: _sync(device), target=0.01)


def _adam_rate(
    device: torch.device,
    numel: int,
    dtype: torch.dtype,
    threads: int | None = None,
    state: AdamState = ADAM_STATE["fp32"],
) -> float:
    step = _adam_update(device, numel, dtype, threads, state)
    return numel / _median_time(step, sync=lambda: _sync(device))


def _adam_update(
    device: torch.device,
    numel: int,
    dtype: torch.dtype,
    threads: int | None = None,
    state: AdamState = ADAM_STATE["fp32"],
) -> Callable[[], None]:
    """One update of ``numel`` elements on ``device`` by the engine's kernel (on the CPU with
    ``threads`` OpenMP threads), on arenas allocated (and first touched) by this process, holding
    values like a training run's.

    [Note: values] Not zeros: on some CPUs the update's divides and square roots run faster on them
    than on a run's values (docs/planning.md, "The hardware profile")."""
    kernel = select_kernel(device, threads if device.type == "cpu" else None)
    gen = torch.Generator(device=device).manual_seed(0)

    def alloc(dt: torch.dtype, std: float) -> torch.Tensor:
        t = torch.empty(numel, dtype=dt, device=device)
        return t.normal_(0.0, std, generator=gen) if std else t.zero_()

    exact = {
        "master": alloc(torch.float32, 0.02),
        "exp_avg": alloc(torch.float32, 1e-4),
        "exp_avg_sq": alloc(torch.float32, 1e-4).square_(),
    }
    grad, out = alloc(dtype, 1e-3), alloc(dtype, 0.0)
    segments, steps, held = (
        [GroupRange(0, numel, 0)],
        iter(range(1, 10**6)),
        AdamTensors(state, encode_state(state, exact)),
    )

    def step() -> None:
        kernel.step(held, grad, out, segments, _HYPER, next(steps), 1.0)

    return step


# -------------------------------------------------------------------------------- CPU Adam per rank


def rank_counts(gpus: int | None = None) -> list[int]:
    """The numbers of ranks per host ``measure_hardware`` measures CPU Adam for: 1, 2, 4, 8 and
    ``gpus`` (default: the GPUs here, 1 without), up to ``gpus``. A job with another count measures
    its own at ``prepare``."""
    gpus = (torch.cuda.device_count() or 1) if gpus is None else gpus
    return sorted({n for n in (1, 2, 4, 8, gpus) if n <= gpus})


def rank_cpu_adam(
    threads: int,
    device: torch.device | None,
    barrier: Callable[[], object],
    *,
    quick: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    state: AdamState = ADAM_STATE["fp32"],
) -> tuple[float, float]:
    """(under copies, alone): this rank's CPU Adam parameters/s while every rank of the host runs
    this at once (``barrier()`` returns when all have reached it; see [Note: CPU Adam per rank]).
    The engine's kernel with ``threads`` threads, timed over the same window on every rank, first
    alone, then while ``device`` (this rank's GPU; ``None`` without one: the rate alone twice)
    copies a pinned buffer up and down back to back. At least 8 of the kernel's largest work
    blocks (2**18 elements) per thread, as the engine's chunk shards (10**8 elements and more)."""
    numel = max(2**20 if quick else 2**25, threads * (2**18 if quick else 2**21))
    window = 0.05 if quick else 0.3
    step = _adam_update(torch.device("cpu"), numel, dtype, threads, state)
    one = _window(step, 0)  # first use: the segment table, the pages
    barrier()
    alone = numel / _window(step, window)
    if device is None:
        barrier()
        return alone, alone
    size = (16 if quick else 256) * 2**20
    dev_a, dev_b = (torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2))
    host_a, host_b = (empty_host(size, torch.uint8, pin=True) for _ in range(2))
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def copies(rounds: int) -> None:
        for _ in range(rounds):
            with torch.cuda.stream(up):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(down):
                host_b.copy_(dev_b, non_blocking=True)

    start = time.perf_counter()
    copies(1)
    torch.cuda.synchronize(device)
    per_copy = time.perf_counter() - start
    barrier()
    copies(int(3 * max(window, 3 * one) / per_copy) + 2)  # queued first: they run through the whole window
    time.sleep(per_copy)  # under way
    under = numel / _window(step, window)
    torch.cuda.synchronize(device)
    barrier()
    return under, alone


def host_cpu_adam(
    ranks: int,
    *,
    threads: int | None = None,
    quick: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    state: AdamState = ADAM_STATE["fp32"],
) -> CpuAdamRate:
    """CPU Adam per rank for ``ranks`` ranks sharing this host, each with ``cpu_adam_threads(ranks,
    threads)``: this process for one rank, else ``ranks`` processes spawned at once, one per GPU
    (``OMP_NUM_THREADS=1`` as under torchrun), the slowest rank's."""
    gpus = torch.cuda.device_count()
    if gpus and ranks > gpus:
        raise ValueError(f"CPU Adam for {ranks} ranks per host needs {ranks} GPUs to copy to; this host has {gpus}")
    n_threads = cpu_adam_threads(ranks, threads)
    if ranks == 1:
        under, alone = rank_cpu_adam(
            n_threads, torch.device("cuda", 0) if gpus else None, lambda: None, quick=quick, dtype=dtype, state=state
        )
        return CpuAdamRate(1, n_threads, under, alone)
    ctx = torch.multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(
            target=_spawned_rank, args=(r, n_threads, bool(gpus), quick, dtype, state.moments, barrier, results)
        )
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        rates = [results.get(timeout=_SPAWNED_TIMEOUT_S) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=_SPAWNED_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    errors = [r for r in rates if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"CPU Adam measurement of {ranks} ranks failed: {errors[0]}")
    return CpuAdamRate(ranks, n_threads, min(u for u, _ in rates), min(a for _, a in rates))


_SPAWNED_TIMEOUT_S = 300


def _spawned_rank(
    rank: int,
    threads: int,
    gpu: bool,
    quick: bool,
    dtype: torch.dtype,
    moments: str,
    barrier: Barrier,
    results: Queue[tuple[float, float] | str],
) -> None:
    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if gpu else None
        if device is not None:
            torch.cuda.set_device(device)
        wait = lambda: barrier.wait(_SPAWNED_TIMEOUT_S)  # noqa: E731
        results.put(rank_cpu_adam(threads, device, wait, quick=quick, dtype=dtype, state=ADAM_STATE[moments]))
    except Exception as exc:  # reported by the parent, which raises
        barrier.abort()
        results.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def job_cpu_adam(
    coll: Collectives,
    device: torch.device,
    ranks: int,
    threads: int,
    *,
    quick: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    state: AdamState = ADAM_STATE["fp32"],
) -> CpuAdamRate:
    """The job's CPU Adam per rank: ``rank_cpu_adam`` on every rank of ``coll`` at once (``ranks``
    of them on each host) with ``threads`` threads, the slowest rank's. Every rank must call it."""

    def barrier() -> None:
        t = torch.zeros(1, device=device)
        coll.all_reduce_sum_(t)
        _sync(device)

    gpu = device if device.type == "cuda" else None
    under, alone = rank_cpu_adam(threads, gpu, barrier, quick=quick, dtype=dtype, state=state)
    slowest = torch.tensor([-under, -alone], dtype=torch.float64, device=device)
    coll.all_reduce_max_(slowest)
    return CpuAdamRate(ranks, threads, -float(slowest[0]), -float(slowest[1]))


def _window(step: Callable[[], None], seconds: float) -> float:
    """Seconds per call of ``step``, called back to back for at least ``seconds`` (at least once)."""
    calls, start = 0, time.perf_counter()
    while True:
        step()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


# ---------------------------------------------------------------------------------------- CPU


def _measure_cpu(quick: bool) -> HardwareProfile:
    cpu = torch.device("cpu")
    copy = _copy_rate(cpu, (16 if quick else 128) * 2**20)
    adam = _adam_rate(cpu, 2**20 if quick else 2**24, torch.bfloat16, cpu_adam_threads(1))
    adam8 = _adam_rate(cpu, 2**20 if quick else 2**24, torch.bfloat16, cpu_adam_threads(1), ADAM_STATE["8bit"])
    host = host_total()
    return HardwareProfile(
        device="cpu",
        gpus=1,
        gpu_memory=host,
        host_memory=host,
        cpu_cores=usable_cores(),
        matmul={str(s): _gemm_rate(s, s, s, torch.float32, cpu) for s in ([128, 256] if quick else [256, 512, 1024])},
        attention=_attention_rates(torch.float32, cpu, quick),
        memory_bandwidth=copy * 2,
        elementwise=_elementwise_rate(torch.float32, cpu, quick),
        op_overhead=_op_overhead(cpu),
        gpu_adam=adam,
        gpu_adam8=adam8,
        links={1: LinkRates(1, copy, copy)},
        dtype="float32",
    )


# ---------------------------------------------------------------------------------- collectives


def collective_busbw(coll: Collectives, device: torch.device, dtype: torch.dtype, nbytes: int = 64 * 2**20) -> float:
    """Bus bandwidth (bytes/s) of the engine's own all-gather + reduce-scatter of an ``nbytes``
    chunk on the job's process group (NCCL over the real topology on GPUs): the median of three
    samples of five calls, the slowest rank's (one sample alone is noisy: docs/planning.md, "The
    hardware profile"). Every rank of the group must call it."""
    n = coll.world_size
    elt = torch.empty((), dtype=dtype).element_size()
    full = torch.zeros(max(n, nbytes // elt // n * n), dtype=dtype, device=device)

    def both() -> None:
        coll.all_gather_(full)
        coll.reduce_scatter_avg_(full)

    both()  # the first collective sets the communicator up
    _sync(device)
    calls, samples = 5, []
    for _ in range(3):  # the same count on every rank: a collective's partners must match
        start = time.perf_counter()
        for _ in range(calls):
            both()
        _sync(device)
        samples.append((time.perf_counter() - start) / calls)
    elapsed = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
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
