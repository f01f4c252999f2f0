"""Predicted seconds of one optimizer step for a placement, per rank: what the engine overlaps and what not.

Rates come from the hardware profile (``hardware/profile.py`` ``Rates``), timelines (when each
forward unit starts, when each chunk's gradients complete in backward) from the model profile,
in compute seconds (``access.unit_work`` shares a phase's unplaced compute over its units).
The model term by term, and its checks against measured steps: docs/planning.md, "Predicted step
time" and "Exposed CPU Adam".

What the model assumes of the engine:

* Gathers run on the fetch stream, under compute only when the rCache has a block to prefetch
  into (``prefetch > 0`` and ``n_blocks > min_blocks``); the first gather and the last reduction
  of a step are exposed.
* CPU updates of offloaded chunks run on one host thread in the next forward's order (the
  chunks the root acquires, then chunk order), each starting at
  ``max(its gradient shard landed, previous update done)``; after a host sync (``clips_grads``)
  they start at the end of backward, at the rate alone but for what the forward's uploads of
  offloaded chunks take from them (``fetch_drag``). With the device lane (``runtime/device_lane.py``)
  the CPU takes ``LANE_SLICE`` slices from the front, the lane from the back (``_two_lanes``).
* The next forward waits only for its latest chunk: ``exposed CPU Adam = max(0, max_k late_k)``
  (stalls do not add); without prefetching, counted from when the forward reaches each chunk
  after its in-line gathers ([Note: in-line gathers and late updates]). Chunks the root acquires
  (parameters read outside their units) are needed when the forward starts, and updated first.
* A collective hidden under compute still slows it by ``COLLECTIVE_DRAG`` of its own time
  ([Note: collectives beside compute]).
* The CPU update runs at ``ARENA_RATE`` of the profile's CPU Adam rate ([Note: the arenas' rate]),
  or after a synced backward at the rate a job on this machine observed (``CpuAdamRate.observed``).

[Note: serial step] The search ranks by ``StepTime.serial``, not ``total``: it trusts the device's
own overlaps (collectives, copies from GPU-resident arenas) and puts the host's transfers and
updates back to back, because the host's overlaps are the ones the machine does not deliver
(docs/planning.md, "Why not the overlapped prediction")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import numpy as np
import torch

from ..adam_state import AdamState
from ..chunk.layout import ChunkLayout
from ..hardware.profile import Rates, attention_keys
from ..profiler.timeline import Cost
from ..runtime.device_lane import LANE_SLICE
from ..runtime.host_updates import update_order
from .access import BWD, FWD, AccessTrace
from .belady import MissTable

__all__ = [
    "StepTime",
    "StepModel",
    "compute_time",
    "roofline_parts",
    "with_held_copies",
    "COLLECTIVE_DRAG",
    "ARENA_RATE",
]

COLLECTIVE_DRAG = 0.45
"""Seconds of compute lost per second of an NCCL collective running beside it.

[Note: collectives beside compute] NCCL's all-gathers and reduce-scatters are kernels: run beside
the compute, they take SMs and HBM bandwidth from it, so a collective hidden under compute still
lengthens that compute by this share of its own time; the copy engines' H2D/D2H take nothing.
One value for every model and rank count, calibrated on the recorded multi-GPU runs (docs/planning.md,
"Predicted step time"); it enters ``serial`` too, so the search pays for each gather it hides."""

ARENA_RATE = 0.85
"""The CPU update's rate on the engine's host arenas, as a share of the profile's CPU Adam rate.

[Note: the arenas' rate] The hardware profile times the kernel on a small set of arenas it has
just allocated; a run updates its whole set of pinned arenas, which can run slower
(``benchmarks.step_anatomy`` compares the two on one machine). One value for every model and rank
count, calibrated on the recorded runs that update offloaded chunks after a host sync
(``benchmarks.replay``; the numbers: docs/planning.md, "Step-time prediction checked"); applied to
the rate under copies too, which no recorded run calibrates."""


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, per rank."""

    total: float
    compute: float
    h2d: float
    d2h: float
    collectives: float | None
    """``None`` when the collective bandwidth was not measured for this many GPUs."""
    gpu_adam: float
    cpu_adam: float
    exposed_transfers: float
    """Transfer time not hidden under compute."""
    exposed_cpu_adam: float
    """Update time of offloaded chunks the next forward waits for (both lanes, the submissions included)."""
    rcache_bytes: int
    """Bytes gathered into the rCache per step (the paper's chunk-size criterion)."""
    serial: float
    """What the search minimises: the device's own transfers overlapped as predicted, then every
    host transfer and update back to back ([Note: serial step])."""
    device_lane_adam: float = 0.0
    """Seconds the device lane updates offloaded slices (0: no lane); ``cpu_adam`` is then the CPU's part."""

    def to_dict(self) -> dict[str, float | None]:
        return {
            k: (None if v is None else float(v) if k != "rcache_bytes" else int(v)) for k, v in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTime:
        return cls(**data)


def roofline_parts(cost: Cost, rates: Rates) -> dict[str, float]:
    """Seconds of ``cost`` by kind of kernel: GEMMs (and convolutions) at their size class's rate,
    fused attention at its length's, the other ops' bytes at the memory-bound ops' rate (``memory``)."""
    parts = {"gemm": 0.0, "attention": 0.0, "memory": cost.bytes / rates.elementwise}
    for cls, flops in cost.flops.items():
        parts["gemm" if attention_keys(cls) is None else "attention"] += flops / rates.flop_rate(cls)
    return parts


def roofline(cost: Cost, rates: Rates) -> float:
    return sum(roofline_parts(cost, rates).values())


def compute_time(cost: Cost, rates: Rates, extra_ops: float = 0.0) -> float:
    return max(roofline(cost, rates), (cost.ops + extra_ops) * rates.op_overhead)


class StepModel:
    """Everything about a layout that does not depend on the placement, precomputed once."""

    def __init__(
        self,
        layout: ChunkLayout,
        trace: AccessTrace,
        compute: dict[str, Cost],
        rates: Rates,
        dtype: torch.dtype,
        *,
        min_blocks: int,
        prefetch: int,
        root: tuple[int, ...] = (),
        micro_batches: int = 1,
        clips_grads: bool = True,
        device_lane: bool = False,
        state: AdamState,
        misses: MissTable | None = None,
    ) -> None:
        """``state``: the optimizer state of a trainable element (``rates`` are its kernels'); ``misses``:
        ``trace``'s, where another model of the layout has them (``MissTable(trace.groups, trace.phases, k)``)."""
        self.layout, self.rates = layout, rates
        self.min_blocks, self.prefetch, self.micro = min_blocks, prefetch, micro_batches
        self.clips_grads = clips_grads
        """The training loop syncs the host (``clip_grad_norm``, fp16) before ``step()``: the CPU
        updates start after backward; otherwise as each chunk's gradients land during backward."""
        elt = torch.empty((), dtype=dtype).element_size()
        self.lane_rate = 0.0
        """Elements per second the device lane updates (0: no lane): ``min(duplex / lane_bytes, gpu_adam)``."""
        if device_lane:
            up, down = lane_bytes(dtype, state)
            link_up, link_down = rates.duplex or rates.h2d, rates.duplex or rates.d2h
            self.lane_rate = 1.0 / max(up / link_up, down / link_down, 1.0 / rates.gpu_adam)
        alone = rates.cpu_adam_alone if clips_grads and not device_lane else None
        after_backward = bool(alone)
        observed = rates.cpu_update_observed if after_backward else None
        self.cpu_rate = observed or ARENA_RATE * (alone or rates.cpu_adam)
        """Elements per second of the CPU Adam on the engine's arenas: after a synced backward without
        the lane, the rate a job on this machine observed (``cpu_update_observed``) or else the
        profile's rate alone; its rate under copies otherwise (docs/planning.md, ``cpu_adam[n]``);
        a profile's rate times ``ARENA_RATE``."""
        self.fetch_drag = fetch_drag(rates) if after_backward and not observed else 0.0
        """CPU seconds an update run at the rate alone loses per second of a forward fetch beside it
        ([Note: updates beside the forward's fetches]); none at an observed rate, which includes them."""
        n = layout.world_size
        chunks = layout.chunks
        self.k = len(chunks)
        self.shard = np.array([layout.shard_numel(c) * elt for c in chunks], dtype=np.float64)
        self.full = np.array([c.numel * elt for c in chunks], dtype=np.float64)
        self.trainable = np.array([c.trainable for c in chunks])
        self.private = np.array([c.private for c in chunks])
        master = 4 if dtype != torch.float32 else elt
        self.gather_read = np.where(self.trainable, self.shard / elt * master, self.shard)
        """Bytes a gather of a GPU-resident shard reads: a trainable one's fp32 master, cast into the
        rCache in mixed precision (``chunk/store.py`` ``casts_on_gather``); else the shard."""
        self.copy_seconds = {
            gather: (read + self.shard) / rates.memory_bandwidth
            for gather, read in ((True, self.gather_read), (False, self.shard))
        }
        """Seconds of each chunk's copy from (``True``: a gather) or to a GPU-resident arena, read and written."""
        self._over_link: dict[float, np.ndarray] = {}
        """Seconds of each chunk's shard over a link, by the link's bytes/s (``_host_link``)."""
        self.elements = np.array([layout.shard_numel(c) if c.trainable else 0 for c in chunks], dtype=np.float64)
        self.coll_known = n == 1 or rates.busbw is not None
        self.coll = self.full * (n - 1) / n / rates.busbw if n > 1 and rates.busbw else np.zeros(self.k)
        self.table = misses if misses is not None else MissTable(trace.groups, trace.phases, self.k)
        self.private_gathers = (self.private & self.trainable).astype(np.float64)
        self.compute = compute
        self.roofline = {phase: roofline(cost, rates) for phase, cost in compute.items()}
        """Each phase's roofline seconds: what ``compute_time`` takes the larger of with its ops' overhead,
        the same for every placement, so ``step`` does not price the GEMMs again."""
        self.compute_fwd = self._compute_time("fwd")
        self.compute_bwd = self._compute_time("bwd")
        self.unit_start, self.first_need, self.first, self.last = self._forward(trace)
        self.root_set = frozenset(root)
        """Chunks the root's pre-forward acquires before any unit: needed first, updated first."""
        self.first_need[list(root)] = 0.0
        self.grad_ready = self._backward(trace)
        order = np.argsort(self.grad_ready, kind="stable")
        self._reduce_order = order[self.trainable[order]]  # the reduce stream's order in backward

    def _compute_time(self, phase: str, extra_ops: float = 0.0) -> float:
        """``compute_time(self.compute[phase], self.rates, extra_ops)``, its roofline computed once."""
        return max(self.roofline[phase], (self.compute[phase].ops + extra_ops) * self.rates.op_overhead)

    def _starts(self, trace: AccessTrace, phase: int, total: float) -> tuple[list[int], np.ndarray]:
        """The events of ``phase`` and when each starts, in compute seconds since the phase began:
        the compute placed before each event, plus the rest of the phase's ``total`` (the units' own
        compute after their acquisition, in no event's ``before``) shared by the units' work."""
        events = [i for i, p in enumerate(trace.phases) if p == phase]
        if not events:
            return events, np.zeros(0)
        before = np.array([compute_time(trace.costs[i], self.rates) for i in events], dtype=np.float64)
        work = np.array([trace.work[i] for i in events] if trace.work else [1.0] * len(events), dtype=np.float64)
        if work.sum() <= 0:
            work[:] = 1.0
        share = work / work.sum()
        rest = max(0.0, total - float(before.sum()))
        return events, np.cumsum(before) + rest * (np.cumsum(share) - share)

    def _forward(self, trace: AccessTrace) -> tuple[np.ndarray, np.ndarray, int | None, int | None]:
        """In compute seconds since the forward began: when each forward unit event starts and when
        the forward first needs each chunk; the first chunk gathered in forward and the last chunk
        to finish backward."""
        fwd, start = self._starts(trace, FWD, self.compute_fwd)
        need = np.full(self.k, self.compute_fwd)
        first = last = None
        for e, i in enumerate(fwd):
            for c in trace.touched[i]:
                need[c] = min(need[c], start[e])
            if first is None and trace.touched[i]:
                first = trace.touched[i][0]
        for chunks, phase in zip(trace.touched, trace.phases):
            if phase == BWD and chunks:
                last = chunks[0]
        return start, need, first, last

    def _backward(self, trace: AccessTrace) -> np.ndarray:
        """In compute seconds since the backward began: when each chunk's gradients are complete,
        i.e. the end of the last backward unit that uses it (the start of the next backward event,
        or the end of backward). Chunks no backward unit uses: the end of backward."""
        bwd, start = self._starts(trace, BWD, self.compute_bwd)
        end = np.append(start[1:], self.compute_bwd) if len(bwd) else start
        ready = np.full(self.k, self.compute_bwd)
        seen = np.zeros(self.k, dtype=bool)
        for e in range(len(bwd) - 1, -1, -1):  # the last use of a chunk in backward decides
            for c in trace.touched[bwd[e]]:
                if not seen[c]:
                    seen[c], ready[c] = True, min(end[e], self.compute_bwd)
        return ready

    def _transfer(self, on_device: np.ndarray, link: float, gather: bool = True) -> np.ndarray:
        """Seconds to move each chunk's shard between its arena and the rCache (``gather``) or back."""
        return cast(np.ndarray, self._device_copy(on_device, gather) + self._host_link(on_device, link))

    def _device_copy(self, on_device: np.ndarray, gather: bool = True) -> np.ndarray:
        """The device's part: a copy from (``gather``) or to a GPU-resident arena, read and written."""
        return np.where(on_device, self.copy_seconds[gather], 0.0)

    def _host_link(self, on_device: np.ndarray, link: float) -> np.ndarray:
        """The host's part: an offloaded shard over the link."""
        over = self._over_link.get(link)
        if over is None:
            over = self._over_link[link] = self.shard / link
        return np.where(on_device, 0.0, over)

    def misses(self, n_blocks: int) -> np.ndarray:
        m = self.table.misses(n_blocks).astype(np.float64)
        m[FWD] += self.private_gathers
        return m

    def _linear_parts(self, n_blocks: int, host_only: bool) -> tuple[np.ndarray, np.ndarray]:
        """Each chunk's share of ``linear`` on the device and offloaded."""
        m = self.misses(n_blocks)
        r, gathers = self.rates, m[FWD] + m[BWD]
        over = self.shard * (gathers / r.h2d + self.trainable / r.d2h)  # its uploads and gradient offload
        offloaded = self.micro * over + self.elements / (self.cpu_rate + self.lane_rate)
        on_device = self.elements / r.gpu_adam
        if not host_only:
            up, down = self.copy_seconds[True] + self.coll, (self.copy_seconds[False] + self.coll) * self.trainable
            offloaded = offloaded + self.micro * (gathers * self.coll + self.coll * self.trainable)
            on_device = on_device + self.micro * (gathers * up + down)
        return on_device, offloaded

    def linear(self, n_blocks: int, on_device: np.ndarray, host_only: bool = False) -> float:
        """Every transfer and update back to back: the total the I(n)/J(n) comparison reduces.
        ``host_only``: only the host's part (the links to offloaded chunks' arenas, the updates)."""
        on, off = self._linear_parts(n_blocks, host_only)
        return float(np.where(on_device, on, off).sum())

    def linear_uploaded(self, n_blocks: int) -> np.ndarray:
        """``[k + 1]``: ``linear`` with the first ``u`` chunks on the device, for every ``u`` (the greedy
        path's points: ``placement.greedy_path``)."""
        on, off = self._linear_parts(n_blocks, host_only=False)
        return np.concatenate(([0.0], np.cumsum(on))) + np.concatenate((np.cumsum(off[::-1])[::-1], [0.0]))

    def _computes(self, m: np.ndarray, trainable_host: np.ndarray) -> tuple[float, float]:
        """Forward and backward compute seconds with the ops of these misses and offloaded chunks."""
        compute_fwd = self._compute_time("fwd", 2 * m[FWD].sum())
        compute_bwd = self._compute_time("bwd", 2 * m[BWD].sum() + 2 * self.trainable.sum() + trainable_host.sum())
        return compute_fwd, compute_bwd

    def serial(self, n_blocks: int, on_device: np.ndarray) -> float:
        """``step(n_blocks, on_device).serial`` alone (the same arithmetic), without the rest of the step."""
        m = self.misses(n_blocks)
        compute_fwd, compute_bwd = self._computes(m, ~on_device & self.trainable)
        overlap = self.prefetch > 0 and n_blocks > self.min_blocks
        return self._serial(n_blocks, on_device, m, self.inline(n_blocks, overlap), compute_fwd, compute_bwd, overlap)

    def _serial(
        self,
        n_blocks: int,
        on_device: np.ndarray,
        m: np.ndarray,
        inline: np.ndarray,
        compute_fwd: float,
        compute_bwd: float,
        overlap: bool,
    ) -> float:
        """The device's own transfers alone (collectives, copies from GPU-resident arenas) as they
        overlap, what ``serial`` trusts (see ``StepTime.serial``), then the host's part back to back."""
        on_gpu = self._device_copy(on_device) + self.coll
        to_gpu = (self._device_copy(on_device, gather=False) + self.coll) * self.trainable
        fwd_gpu, bwd_gpu = self._phases(m, inline, on_gpu, on_gpu, to_gpu, compute_fwd, compute_bwd, overlap)
        return self.micro * (fwd_gpu + bwd_gpu) + self.linear(n_blocks, on_device, host_only=True)

    def step(self, n_blocks: int, on_device: np.ndarray) -> StepTime:
        r = self.rates
        m = self.misses(n_blocks)
        host = ~on_device
        trainable_host = host & self.trainable
        compute_fwd, compute_bwd = self._computes(m, trainable_host)
        up_b = r.duplex or r.h2d
        down_b = r.duplex or r.d2h
        gather_f = self._transfer(on_device, r.h2d) + self.coll
        gather_b = self._transfer(on_device, up_b) + self.coll
        reduce = (self._transfer(on_device, down_b, gather=False) + self.coll) * self.trainable
        overlap = self.prefetch > 0 and n_blocks > self.min_blocks
        inline = self.inline(n_blocks, overlap)
        fwd, bwd = self._phases(m, inline, gather_f, gather_b, reduce, compute_fwd, compute_bwd, overlap)
        gpu_adam = float(self.elements[on_device].sum() / r.gpu_adam)
        submit = float(trainable_host.sum() * r.op_overhead)  # one CPU update handed to the host thread per chunk
        exposed_cpu = cpu_busy = lane_busy = 0.0
        if trainable_host.any():
            # [Note: in-line gathers and late updates] A prefetched chunk's upload runs ahead of
            # its first use, so its update must be done ``gather_f`` before the forward needs it.
            # A chunk gathered in line ([Note: gathers in line] in belady.py; every chunk with
            # the rCache at its minimum or ``prefetch=0``)
            # is gathered when the forward reaches it, after its in-line gathers of the chunks
            # before: it reaches chunk k that much later than its compute alone would, and k's
            # upload is the in-line gather already counted in the forward's time. Only each
            # chunk's first gather is counted before the chunks after it (a re-gather may come
            # after them): the wait is never under-predicted.
            first_inline = np.minimum(inline[FWD], 1)
            ahead = (1 - first_inline) * gather_f if overlap else 0.0
            lead = ahead - self._inline_before(first_inline * gather_f)
            exposed_cpu, cpu_busy, lane_busy = self._late_updates(trainable_host, reduce, lead, gpu_adam, submit)
        compute = self.micro * (compute_fwd + compute_bwd)
        total = self.micro * (fwd + bwd) + gpu_adam + exposed_cpu
        gathers = m[FWD] + m[BWD]
        return StepTime(
            total=total,
            compute=compute,
            h2d=self.micro * float(gathers[host] @ (self.shard[host] / r.h2d)),
            d2h=self.micro * float((self.shard * (host & self.trainable)).sum() / r.d2h),
            collectives=self.micro * float(gathers @ self.coll + (self.coll * self.trainable).sum())
            if self.coll_known
            else None,
            gpu_adam=gpu_adam,
            cpu_adam=cpu_busy,
            exposed_transfers=self.micro * (fwd + bwd) - compute,
            exposed_cpu_adam=exposed_cpu,
            device_lane_adam=lane_busy,
            rcache_bytes=int(self.micro * float(gathers @ self.full)),
            serial=self._serial(n_blocks, on_device, m, inline, compute_fwd, compute_bwd, overlap),
        )

    def inline(self, n_blocks: int, overlap: bool) -> np.ndarray:
        """``[2, k]``: the gathers of ``misses`` run in line with the compute: those without a free
        block to prefetch into (``MissTable.inline``, [Note: gathers in line] in belady.py), every
        one without prefetching."""
        if not overlap:
            return self.misses(n_blocks)
        return self.table.inline(n_blocks)

    def _phases(
        self,
        m: np.ndarray,
        inline: np.ndarray,
        gather_f: np.ndarray,
        gather_b: np.ndarray,
        reduce: np.ndarray,
        compute_fwd: float,
        compute_bwd: float,
        overlap: bool,
    ) -> tuple[float, float]:
        """Forward and backward seconds of one micro-batch with these per-chunk gather and reduce
        times: under compute when the rCache has a block to prefetch into, in line with it
        otherwise (``inline``: the gathers that find no free block, [Note: gathers in
        line] in belady.py); the first gather and the last reduction are always exposed."""
        fetch_f, fetch_b, reduced = float(m[FWD] @ gather_f), float(m[BWD] @ gather_b), float(reduce.sum())
        head = gather_f[self.first] if self.first is not None else 0.0
        tail = reduce[self.last] if self.last is not None else 0.0
        # the collectives slow the compute they hide under ([Note: collectives beside compute]);
        # the reductions run beside backward even without prefetching
        reduce_coll = float((self.coll * self.trainable).sum())
        drag_b = COLLECTIVE_DRAG * reduce_coll
        if overlap:
            drag_f = COLLECTIVE_DRAG * float((m[FWD] - inline[FWD]) @ self.coll)
            drag_b += COLLECTIVE_DRAG * float((m[BWD] - inline[BWD]) @ self.coll)
            inline_f, inline_b = float(inline[FWD] @ gather_f), float(inline[BWD] @ gather_b)
            return (
                max(compute_fwd + drag_f + inline_f, fetch_f) + head,
                max(compute_bwd + drag_b + inline_b, fetch_b, reduced) + tail,
            )
        return compute_fwd + fetch_f, max(compute_bwd + fetch_b + drag_b, reduced) + tail

    def update_start(self, trainable_host: np.ndarray, reduce: np.ndarray) -> np.ndarray:
        """When each offloaded chunk's CPU update can start, in seconds relative to the end of
        backward (negative: during backward): 0 after a host sync (``clips_grads``); otherwise when
        its reduced gradient shard has landed in host memory: the reductions run on one stream in
        the order the gradients complete, each taking ``reduce`` seconds."""
        if self.clips_grads:
            return np.zeros(self.k)
        order = self._reduce_order
        landed = np.zeros(self.k)
        landed[order] = _queue(self.grad_ready[order], reduce[order])
        end = max(self.compute_bwd, float(landed.max(initial=0.0)))  # the optimizer waits for the last one
        return np.where(trainable_host, landed - end, 0.0)

    def _inline_before(self, cost: np.ndarray) -> np.ndarray:
        """For each chunk, the seconds of ``cost`` (each chunk's forward gathers, run in line) the
        forward spends on the chunks it needs before that one (by first need, the root's first,
        then chunk order)."""
        rooted = np.isin(np.arange(self.k), list(self.root_set))  # acquired before any unit
        order = np.lexsort((np.arange(self.k), ~rooted, self.first_need))
        before = np.empty(self.k)
        before[order] = np.cumsum(cost[order]) - cost[order]
        return before

    def _late_updates(
        self,
        trainable_host: np.ndarray,
        reduce: np.ndarray,
        lead: np.ndarray,
        gpu_adam: float,
        submit: float,
    ) -> tuple[float, float, float]:
        """How long the next forward waits for the updates of offloaded chunks, and how long the
        CPU and the device lane work on them (seconds). ``lead``: how long before its first need
        in the forward's compute each chunk's update must be done (negative: after it; [Note:
        in-line gathers and late updates])."""
        # In seconds since the end of backward: the host thread takes the chunks in the next
        # forward's order (``host_updates.update_order``, as the engine's queue), each once
        # its gradients are there and the previous update is done (the device lane, if any, takes
        # slices from the back).
        ready = self.update_start(trainable_host, reduce)
        mine = np.array(update_order(np.flatnonzero(trainable_host).tolist(), self.root_set), dtype=np.int64)
        done = np.zeros(self.k)
        if self.lane_rate:
            done[mine], cpu_busy, lane_busy = _two_lanes(
                ready[mine], self.elements[mine], self.cpu_rate, self.lane_rate
            )
        else:
            cpu_each = self.elements[mine] / self.cpu_rate
            # each update but the first beside the upload of the chunk before it ([Note: updates
            # beside the forward's fetches]; 0 without a host sync: the rate under copies)
            cpu_each[1:] += self.fetch_drag * self.shard[mine][:-1] / self.rates.h2d
            done[mine], cpu_busy, lane_busy = _queue(ready[mine], cpu_each), float(cpu_each.sum()), 0.0
        # The next forward starts after the device Adam; after a host sync also after the
        # submissions (without one, they were made while the GPU was still in backward). The
        # Python thread waits for a chunk's update only at the demand acquire of its first user
        # (a prefetch skips a chunk whose update is running): the GPU runs what was queued before
        # meanwhile, and the upload after the update must land before the first user (``lead``).
        # (The profiled forward, without the engine's own ops: never later than the real one.)
        head = gpu_adam + (submit if self.clips_grads else 0.0)
        needed = head + self.first_need - lead
        late = (done - needed)[trainable_host]
        return (submit if self.clips_grads else 0.0) + max(0.0, float(late.max())), cpu_busy, lane_busy


def fetch_drag(rates: Rates) -> float:
    """Seconds the CPU Adam, measured at ``cpu_adam_alone``, loses per second of an H2D beside it.

    [Note: updates beside the forward's fetches] After a synced backward the worker updates chunk
    k while the forward uploads chunk k-1 (the forward waits chunk by chunk and the upload follows
    the update), so each update but the first runs beside one chunk's H2D. The CPU Adam is bound
    by host memory bandwidth, which a DMA shares: the profile measures it alone and under copies up
    and down at once (each direction at ``duplex``). Taking the loss as linear in the DMA's bytes
    per second, a one-way H2D at ``h2d`` costs the update ``h2d / (2 duplex)`` of the loss under
    copies: over ``L`` seconds of upload, ``L · h2d / (2 duplex) · (1 - under / alone)`` seconds
    more. The serial step puts them back to back, without it."""
    alone, under = rates.cpu_adam_alone, rates.cpu_adam
    if not alone or under >= alone:
        return 0.0
    both_ways = 2 * (rates.duplex or min(rates.h2d, rates.d2h))
    return min(1.0, rates.h2d / both_ways) * (1.0 - under / alone)


def lane_bytes(dtype: torch.dtype, state: AdamState) -> tuple[float, float]:
    """Bytes per element the device lane moves up (the optimizer state, the gradient) and down (the
    state and, unless the master is the param (fp32), the compute-dtype param)."""
    elt = torch.empty((), dtype=dtype).element_size()
    held = state.bytes_per_element()
    return held + elt, held + (0 if dtype == torch.float32 else elt)


_MAX_SLICES = 256


def _two_lanes(
    ready: np.ndarray, elements: np.ndarray, cpu_rate: float, lane_rate: float
) -> tuple[np.ndarray, float, float]:
    """When each chunk's update is done with the two lanes of ``runtime/host_updates.py``: slices of
    ``LANE_SLICE`` elements in chunk order, the CPU taking them from the front and the device lane
    from the back, each lane its next slice once it is free, a slice starting once its chunk's
    gradients are ``ready``. Returns the done times and each lane's busy seconds. At most
    ``_MAX_SLICES`` are simulated (coarser slices for huge models: the search calls this for every
    placement it prices; the error is where the lanes meet, within one slice)."""
    size = max(LANE_SLICE, -(-int(elements.sum()) // _MAX_SLICES))
    slices = [(c, min(size, n - lo)) for c, n in enumerate(elements) for lo in range(0, int(n), size)]
    done = np.full(len(elements), -np.inf)
    free = [-np.inf, -np.inf]  # when the CPU / the device lane is free
    busy = [0.0, 0.0]
    rate = (cpu_rate, lane_rate)
    front, back = 0, len(slices) - 1
    first = [True, True]
    while front <= back:
        # each lane starts with its own end's slice, then whichever is free first takes the next
        lane = 0 if first[0] else 1 if first[1] else int(free[1] < free[0])
        first[lane] = False
        c, n = slices[front] if lane == 0 else slices[back]
        if lane == 0:
            front += 1
        else:
            back -= 1
        work = n / rate[lane]
        free[lane] = max(free[lane], ready[c]) + work
        busy[lane] += work
        done[c] = max(done[c], free[lane])
    return done, busy[0], busy[1]


def _queue(ready: np.ndarray, work: np.ndarray) -> np.ndarray:
    """When each job of a one-worker queue finishes, taken in the given order, each starting at
    ``max(ready, previous done)``: ``done_i = max_{j <= i} (ready_j + work_j + ... + work_i)``."""
    if not len(ready):
        return ready
    total = np.cumsum(work)
    return total + np.maximum.accumulate(ready - (total - work))


def with_held_copies(t: StepTime, held: int, rates: Rates) -> StepTime:
    """``t`` with the held block inputs' copies: ``held`` bytes out over D2H and back over H2D, beside compute on
    the host link the chunks' transfers use; what the link then needs beyond the step's compute is exposed."""
    up, down = held / rates.h2d, held / rates.d2h
    link = t.h2d + t.d2h
    extra = max(0.0, link + up + down - t.compute) - max(0.0, link - t.compute)
    return replace(
        t,
        h2d=t.h2d + up,
        d2h=t.d2h + down,
        exposed_transfers=t.exposed_transfers + extra,
        total=t.total + extra,
        serial=t.serial + extra,
    )
