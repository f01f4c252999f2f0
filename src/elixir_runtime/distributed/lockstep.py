"""Lockstep: every rank starts the same engine operation, or every rank is told why not.

A forward of a prepared model is a collective (the ranks gather each chunk together), and so is
``state_dict()``. A forward on some ranks only (sampling or evaluating on the main process) used
to hang until the process group's timeout (30 minutes), and a rank one training step ahead had
its collectives paired with the other ranks' next operation (a save, say) unnoticed.

So each such operation starts with a check-in: the ranks all-gather (operation, how many
operations this rank has started) over a gloo group of their own, on the host, with a timeout
of ``ElixirConfig.lockstep_timeout_s`` (60 s). Different entries fail on every rank at once,
naming what each rank was starting; a rank that waits longer fails naming the operation it
waited at, or, if a rank has stopped running or was killed, ends the job naming that rank
(``heartbeat.py``, which also watches every other collective from the check-in to the step's end).
Either way the failing rank posts its message before it raises, and a rank that ran ahead into
another collective raises that message when its collective fails, not gloo's transport error, or on
NCCL, where nothing releases it, ends with it ([Note: the rank that ran ahead],
``distributed/peer_failure.py``). Cost: one host
all-gather of 40 bytes per forward, no GPU synchronization. The third number is a rank's request
to stop (``request_stop``): every rank learns it from the same check-in, without a collective of
its own. The last two are a training forward's batch shape (``runtime/batch_guard.py``): every rank
judges every rank's batch against the plan, so a batch the plan cannot hold is refused on every
rank at once, not on one while the others wait for it in the forward's first gather. ``full_params``
(``runtime/full_params.py``) is the supported way to run forwards on some ranks only.
"""

from __future__ import annotations

import enum
from datetime import timedelta

import torch
import torch.distributed as dist

from . import heartbeat
from .collectives import Collectives, HeldWork, abort_groups
from .peer_failure import FailureBoard, LockstepError

__all__ = ["Lockstep", "LockstepError", "Op"]


class Op(enum.IntEnum):
    TRAINING_FORWARD = 1
    NO_GRAD_FORWARD = 2
    STATE_DICT = 3
    FULL_PARAMS = 4


_WHAT = {
    Op.TRAINING_FORWARD: "a forward with grad enabled",
    Op.NO_GRAD_FORWARD: "a no-grad forward",
    Op.STATE_DICT: "state_dict() (gathering the weights)",
    Op.FULL_PARAMS: "full_params()",
}

FIX = (
    "Every forward of a model prepared by Elixir is a collective (the ranks gather each chunk together), so a "
    "forward on some ranks only hangs or pairs with another rank's operation. To sample or evaluate on one rank, "
    "enter `with elixir_runtime.full_params(model):` on every rank (ElixirAccelerator.full_params, "
    "elixir_hf.GenerateCallback) and run the forward inside on any rank; to generate on every rank, pass "
    "synced_gpus=True to model.generate; give every rank the same number of training steps."
)


class Lockstep:
    def __init__(self, coll: Collectives, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = coll.rank, coll.world_size, timeout_s
        self.started = 0
        """Operations this rank has checked in for (the same on every rank while they agree)."""
        self.stop_requested = False
        """Whether a rank asked every rank to stop (``request_stop``): set on every rank by the same check-in."""
        self._asked = False
        self.group = self.board = None
        self._held = HeldWork()  # a gloo group's handles ([Note: gloo at exit])
        if coll.world_size > 1:
            ranks = dist.get_process_group_ranks(coll.group or dist.group.WORLD)
            self.group = dist.new_group(
                ranks, timeout=timedelta(seconds=timeout_s), backend="gloo", use_local_synchronization=True
            )
            self.board = coll.board = FailureBoard(self.group.group_name)
            self.board.watch = heartbeat.stop_for_silent  # a failed collective: a rank killed or stopped is named
            heartbeat.start(ranks, timeout_s, self.board, coll.group)  # so is one that stops answering

    def request_stop(self) -> None:
        """This rank asks every rank to stop (the HF integration's preemption: ``elixir_hf/preemption.py``):
        the next check-in, which every rank makes anyway, carries it, so that every rank sees
        ``stop_requested`` from the same operation on; one rank sees it at once."""
        self._asked = True
        if self.group is None:
            self.stop_requested = True

    def check_in(self, op: Op, shape: tuple[int, int] | None = None) -> list[tuple[int, int] | None]:
        """Returns once every rank is starting ``op`` as its operation number ``self.started``: every
        rank's ``shape`` (a training forward's ``(batch, seq)``; ``None``: none given), by rank."""
        if self.group is None or self.board is None:
            return [shape]
        heartbeat.step_started()  # this rank needs the others until its step ends (distributed/heartbeat.py)
        b, s = shape or (0, 0)
        mine = torch.tensor([int(op), self.started, int(self._asked), b, s], dtype=torch.int64)
        self.started += 1
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            self._held.run(dist.all_gather, everyone, mine, group=self.group)
        except RuntimeError as exc:  # gloo: timeout, or a rank that gave up and left
            self.board.raise_posted(exc, "its check-in")  # a rank that gave up first, or stopped: its reason
            error = self.board.post(
                f"Elixir: rank {self.rank} started {_WHAT[op]} (its operation #{mine[1]}) and the other ranks did not "
                f"start one within {self.timeout_s:g} s, or one of them stopped waiting ({type(exc).__name__}: "
                f"{str(exc).strip()[:200]}). {FIX} If a rank legitimately works alone for longer, let the others wait "
                "in a barrier (accelerator.wait_for_everyone()) or raise ElixirConfig.lockstep_timeout_s."
            )
            abort_groups()  # the others are elsewhere: their collectives with this rank fail now, explained
            raise error from exc
        self.stop_requested |= any(bool(t[2]) for t in everyone)
        if any(not torch.equal(t[:2], mine[:2]) for t in everyone):
            each = "; ".join(
                f"rank {r} starts {_WHAT[Op(int(t[0]))]} (operation #{t[1]})" for r, t in enumerate(everyone)
            )
            raise self.board.post(f"Elixir: the ranks are not running the same operation: {each}. {FIX}")
        return [(int(t[3]), int(t[4])) if t[3] else None for t in everyone]

    def barrier(self) -> None:
        """Every rank waits for the others (up to torch's default 30 minutes): the end of ``full_params``,
        so that a long forward on one rank does not trip the others' next check-in."""
        if self.group is not None and self.board is not None:
            with self.board.explained("the barrier at the end of full_params"):
                dist.monitored_barrier(self.group, timeout=dist.default_pg_timeout, wait_all_ranks=True)
