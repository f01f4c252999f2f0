"""``ElixirOptimizer``: the user's Adam/AdamW, run over chunk shards.

It shares the user's ``param_groups`` dicts, so hyperparameters (and a scheduler's LR changes)
are read at every step; the per-parameter state lives in the chunk arenas instead of ``state``.
One step: (optionally) one host sync for the global grad norm / fp16 overflow, then one kernel
call per placement with loss-unscaling and clipping fused into ``div_scale``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch

from ..config import LossScaleConfig
from ..runtime.chunk_runtime import ChunkRuntime, ChunkState
from ..chunk.store import ShardArenas
from ..chunk.layout import GroupRange
from .kernel import AdamHyper
from .select import select_kernel
from .loss_scaler import LossScaler

__all__ = ["ElixirOptimizer"]

_FORMAT = "elixir-optimizer-shard/1"


class ElixirOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        user_optimizer: torch.optim.Optimizer,
        runtime: ChunkRuntime,
        *,
        decoupled: bool,
        loss_scale: LossScaleConfig,
        cpu_threads: int | None = None,
    ) -> None:
        super().__init__(user_optimizer.param_groups, user_optimizer.defaults)
        self.runtime = runtime
        self.decoupled = decoupled
        self.scaler = LossScaler(loss_scale, enabled=runtime.dtype == torch.float16)
        self.step_count = 0
        self.step_was_skipped = False
        self._norm: float | None = None
        self._clip_coef = 1.0
        self.cpu_threads = cpu_threads
        """OpenMP threads of the CPU Adam (``None``: ``torch.get_num_threads()``)."""
        self.kernels = {name: select_kernel(a.device, cpu_threads) for name, a in runtime.arenas.items()}
        host = runtime.arenas["host"]
        self._chunk_segments = {
            c.index: [s for s in host.segments if c.offset <= s.offset < c.offset + c.shard_numel]
            for c in runtime.trainable
            if c.arenas is host
        }

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with loss scaling; grads end up reduced in this rank's shards."""
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward(**kwargs)
        if self.runtime.backward_pending:
            self.runtime.finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted where DDP/Accelerate code expects it; accumulation stays exact without it.

        Each chunk's gradient is reduce-scattered into this rank's shard as soon as it is complete
        and the next micro-step's gradient is added to that shard. Skipping the reduction would
        need a full-size gradient buffer per chunk, the very memory sharding saves, so the
        collectives run every micro-step (as DeepSpeed ZeRO-2/3 do).
        """
        yield

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) grads over all chunks and ranks; one host sync, cached."""
        if self._norm is None:
            self._norm = math.sqrt(self.runtime.grad_norm_sq().item()) / self.scaler.scale
        return self._norm

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Like ``torch.nn.utils.clip_grad_norm_``; the scaling itself is fused into the next step."""
        if norm_type != 2.0:
            raise NotImplementedError(f"only the L2 norm is supported, got norm_type={norm_type}")
        norm = self.grad_norm()
        if math.isfinite(norm):
            self._clip_coef = min(1.0, max_norm / (norm + 1e-6))
        return torch.tensor(norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.runtime.host_updates.wait_all()  # the previous step's CPU updates
        self.runtime.device_grads_ready()
        self.step_was_skipped = False
        if not self.runtime.has_grads:
            return loss
        if self.scaler.enabled and not math.isfinite(self.grad_norm()):
            self.step_was_skipped = True
            self.scaler.update(overflow=True)
            self._reset_norm()
            return loss
        self.step_count += 1
        hypers = [self._hyper(g) for g in self.param_groups]
        div_scale = self.scaler.scale / self._clip_coef
        device = self.runtime.arenas["device"]
        if device.trainable_numel:
            self._update(device, device.segments, hypers, self.step_count, div_scale)
        host = self.runtime.arenas["host"]
        for c in self.runtime.trainable:
            if c.arenas is host:  # chunk order = the order the next forward needs them
                self.runtime.host_updates.submit(
                    c.index, functools.partial(
                        self._update_host_chunk, c, self._chunk_segments[c.index], hypers, self.step_count, div_scale
                    )
                )
        self.scaler.update(overflow=False)
        self.runtime.invalidate_trainable()
        self._reset_norm()
        return loss

    def _update_host_chunk(
        self, c: ChunkState, segments: list[GroupRange], hypers: list[AdamHyper], step: int, div_scale: float
    ) -> None:
        self.runtime.wait_host_chunk(c)
        self._update(c.arenas, segments, hypers, step, div_scale)

    def _update(
        self, a: ShardArenas, segments: list[GroupRange], hypers: list[AdamHyper], step: int, div_scale: float
    ) -> None:
        param_out = None if a.master_is_param else a.param
        self.kernels[a.placement].step(a.master, a.exp_avg, a.exp_avg_sq, a.grad, param_out, segments, hypers, step, div_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.zero_grad()
        self._reset_norm()

    def _reset_norm(self) -> None:
        self._norm = None
        self._clip_coef = 1.0

    def _hyper(self, group: dict) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", self.decoupled)),
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (every rank saves its own)."""
        rt = self.runtime
        rt.wait_for_grads()
        chunks = {}
        for c in rt.trainable:
            sl = slice(c.offset, c.offset + c.shard_numel)
            chunks[c.index] = {k: getattr(c.arenas, k)[sl].detach().cpu().clone() for k in ("master", "exp_avg", "exp_avg_sq")}
        return {
            "format": _FORMAT,
            "rank": rt.coll.rank,
            "world_size": rt.coll.world_size,
            "layout": rt.layout.fingerprint(),
            "step": self.step_count,
            "scaler": self.scaler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "chunks": chunks,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rt = self.runtime
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                "not an Elixir optimizer shard (expected format "
                f"{_FORMAT!r}, got {state_dict.get('format')!r}); was it saved by a plain torch optimizer?"
            )
        if state_dict["world_size"] != rt.coll.world_size or state_dict["rank"] != rt.coll.rank:
            raise ValueError(
                f"optimizer shard of rank {state_dict['rank']}/{state_dict['world_size']} cannot be loaded on rank "
                f"{rt.coll.rank}/{rt.coll.world_size}: resume with the same number of ranks, or load only the model weights"
            )
        if state_dict["layout"] != rt.layout.fingerprint():
            raise ValueError(
                "optimizer shard was saved with a different chunk layout (model, chunk size or world size changed); "
                "resume with the same ElixirConfig, or load only the model weights"
            )
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"optimizer shard has {len(state_dict['param_groups'])} param groups, this optimizer {len(self.param_groups)}"
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        for c in rt.trainable:
            saved = state_dict["chunks"][c.index]
            sl = slice(c.offset, c.offset + c.shard_numel)
            for k in ("master", "exp_avg", "exp_avg_sq"):
                getattr(c.arenas, k)[sl].copy_(saved[k])
        self.step_count = int(state_dict["step"])
        self.scaler.load_state_dict(state_dict["scaler"])
        rt.reload_shards()
