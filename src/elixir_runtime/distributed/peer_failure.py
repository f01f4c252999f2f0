"""A rank that gives up tells the others why: its reason is posted in the job's store, and a
collective that then fails on another rank raises it, not the transport error.

[Note: the rank that ran ahead]
When ranks diverge (``distributed/lockstep.py``: a check-in that times out, or entries that differ),
the rank that finds it out is waiting in a check-in; a rank that ran ahead is blocked in some other
collective (a chunk gather or reduction of the engine, the step's norm, the Trainer's gathers,
``all_ranks_agree``), which nothing can interrupt. It fails only when the first rank's connections
go down (its process ends, or destroys its groups), with gloo's "Connection closed by peer": a
transport error that names neither the cause nor the fix, and only once the first rank's process
has ended, by when ``torchrun`` may already have stopped it (0.1 s after the first exit).

So the first rank posts its message on the engine's ``FailureBoard`` (a key of the default process
group's store, which every rank of the job reaches; under ``torchrun`` the launcher's, which
outlives the ranks); if it timed out (the others are elsewhere, the job cannot go on) it then
aborts its process groups (``collectives.abort_groups``), which fails the collectives the others
are blocked in at once; then it raises. A collective that fails inside ``explained()`` (the engine's gloo collectives,
check-ins and barrier; in ``elixir_hf``, the Trainer's entry points) raises the posted
``LockstepError``, the transport error chained as its cause. Ranks whose entries differ all learn
it from the same check-in and keep their groups. The store is read only once a collective has
failed; the key is the engine's (its lockstep group's name), so an engine built after a caught
failure starts clean. Not on NCCL: a rank ahead in an NCCL collective is not woken by a peer that
left; the launcher stops it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["LockstepError", "FailureBoard", "STALLED_KEY"]

STALLED_KEY = "elixir/stalled"
"""The job's verdict on a rank that stopped answering (``distributed/heartbeat.py``), read as any board's."""


class LockstepError(RuntimeError):
    """The ranks did not start the same engine operation; the message names each rank's and the fix."""


class FailureBoard:
    """Where an engine's ranks leave the reason they gave up (``name``: the same on every rank)."""

    def __init__(self, name: str) -> None:
        self.key = f"elixir/{name}/gave_up"

    def post(self, message: str) -> LockstepError:
        """The error this rank is about to raise, its message first left for the others."""
        store = _store()
        if store is not None:
            with contextlib.suppress(Exception):  # the rank still raises its own error
                store.set(self.key, message)
        return LockstepError(message)

    def posted(self) -> str | None:
        """The message a rank gave up with, or the job's stall verdict, if there is one (a store gone
        with the rank that hosted it: none)."""
        store = _store()
        try:
            key = next((k for k in (self.key, STALLED_KEY) if store is not None and store.check([k])), None)
            return store.get(key).decode() if key is not None else None
        except Exception:  # noqa: BLE001 - no store, no explanation: the caller raises its own error
            return None

    def raise_posted(self, exc: BaseException, where: str) -> None:
        """``exc``, a failed collective at ``where``, as the posted ``LockstepError`` if a rank gave
        up; returns if none did (the caller re-raises ``exc``)."""
        if isinstance(exc, LockstepError) or not isinstance(exc, RuntimeError):
            return  # gloo's transport errors are RuntimeErrors (DistBackendError among them)
        message = self.posted()
        if message is not None:
            raise LockstepError(
                f"{message} [raised on this rank too: {where} failed when that rank gave up ({str(exc).strip()[:120]})]"
            ) from exc

    @contextlib.contextmanager
    def explained(self, where: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            self.raise_posted(exc, where)
            raise


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
