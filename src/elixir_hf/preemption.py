"""Preemption saves: SIGTERM or SIGUSR1 (SLURM's ``--signal``) during ``ElixirTrainer.train`` ends the
run at the end of a step, with a complete, verified checkpoint when one is predicted to fit the grace
period, and exit status ``EXIT_PREEMPTED``.

While ``train()`` runs, the two signals only mark this rank: the time, and its hand raised in the
engine's lockstep (``Lockstep.request_stop``). The step goes on; the next forward's check-in, an
all-gather every rank makes anyway, tells every rank ([Note: agreeing for free]), and every rank
ends that step the same way (``on_step_end``):

* the save is predicted to fit the grace left (``ElixirPlugin.preempt_grace_s``, else
  ``ELIXIR_PREEMPT_GRACE_S``, else 30 s, counted on each rank from its signal; the least over the
  ranks): the Trainer saves ``checkpoint-N`` as it saves any (the marker last, older checkpoints
  rotated after it), and every rank verifies it (``checkpoint.verify``: every file's size and CRC-32);
* it is not: no save, and the newest complete checkpoint stays the one a resume takes.

A signal during a save leaves the save to complete; its ``on_save`` asks every rank (a gather, one per
save) and, if any was signalled, the run stops there, that checkpoint verified as the newest. Then
``train()`` ends as the Trainer ends it (the lock on ``output_dir`` released) and
``ElixirTrainer.train`` raises ``SystemExit(EXIT_PREEMPTED)``: the script's code after ``train()``
(a final ``save_model``, an evaluation) does not run. A process killed meanwhile (the launcher's
SIGKILL once its grace is over) leaves the previous complete checkpoint: every save is atomic
(``checkpoint.py``). Outside ``train()`` the signals keep their own handlers.

The children the run forks meanwhile (the DataLoader's workers) are shielded from the two signals
([Note: the children live on]): the step and its save still need them.

The predicted save time: writing, the longest save of this run so far on this rank (timed from the
step's end, or the evaluation's, to ``on_save``), else the checkpoint's bytes at ``WRITE_RATE``; and
verifying, its bytes at ``VERIFY_RATE``. Its bytes: the last checkpoint's files (its marker), else
every parameter at 4 bytes and every trainable one's Adam state at 12 (fp32 master, two moments).

[Note: agreeing for free]
The signal may reach one rank only (``kill`` of one process), every rank (SLURM, ``torchrun``
forwarding its own SIGTERM) or none but the launcher; the ranks must still end the same step the
same way, or one waits alone in the save's collectives. Agreeing needs a collective after the
signal: a flag all-reduced at every step's end would be one more host synchronization per step,
and on a GPU a stall of the host that runs ahead of it. The lockstep check-in at each forward is
such a collective already (40 bytes on the host, gloo, no GPU synchronization); its third number
carries the flag. The cost: a signal that comes after a step's last forward stops the run one step
later, and a step with no forward (none in the Trainer) could not carry it.

[Note: the children live on]
SLURM's preemption, ``scancel`` and a kill of the process group signal every process, the
DataLoader's workers too. torch's worker handler exits on a SIGTERM its parent did not send, and
the parent's SIGCHLD handler then raises ``DataLoader worker ... killed by signal`` wherever the
main thread is (the step, the save): no checkpoint, exit status 1. So while ``train()`` holds the
handlers, a process it forks (``os.register_at_fork``) blocks SIGTERM and SIGUSR1 in every thread
and takes them from a thread of its own (``sigwaitinfo``, which says who sent each): a SIGTERM from
its parent (the DataLoader ending a worker that did not stop when asked) ends it with status 0, as
torch's handler does; any other is dropped, and the worker serves until the run, stopping at the
step's end, shuts it down. A child that ``exec``s keeps the blocked mask: a program started by
``os.fork`` and ``exec`` inside ``train()`` ignores SIGTERM (``subprocess`` runs no fork hooks, so
its children are unaffected), and children started by ``spawn`` or ``forkserver`` are not shielded.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .checkpoint.format import CheckpointError, _gather, newest_complete, read_marker, verify
from .engine import engine_state

__all__ = ["EXIT_PREEMPTED", "SIGNALS", "VERIFY_RATE", "WRITE_RATE", "Preemption", "shielding_children"]

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""The exit status of a preempted run (sysexits.h's ``EX_TEMPFAIL``: try again later, i.e. requeue and
resume); a run stopped by a rank that stopped answering has its own (``heartbeat.EXIT_STALLED``)."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
WRITE_RATE = 200e6
"""Bytes per second a first save is predicted to write at, summing included: a network file system's
pace, well under a local NVMe's; later saves are predicted from this run's own."""
VERIFY_RATE = 1e9
"""Bytes per second of CRC-32 over files just written (the page cache), a little under a small host's (docs/hf.md)."""


_shielding = 0
"""``train()`` calls holding the handlers: while any does, forked children are shielded."""


@functools.cache
def _shield_forks() -> None:
    """Forked children run ``_after_fork_in_child`` (registered once, by the first ``train()``)."""
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shielding_children() -> bool:
    return _shielding > 0


def _after_fork_in_child() -> None:
    if _shielding:
        parent = os.getppid()
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # this thread and every thread it starts
        threading.Thread(target=_take_signals, args=(parent,), name="elixir-preemption-shield", daemon=True).start()


def _take_signals(parent: int) -> None:
    """A shielded child's signals ([Note: the children live on])."""
    while True:
        got = signal.sigwaitinfo(SIGNALS)
        if got.si_signo == signal.SIGTERM and got.si_pid == parent:
            os._exit(0)


class Preemption(TrainerCallback):
    """``ElixirTrainer``'s preemption: ``trainer`` runs on the engine; see the module docstring."""

    def __init__(self, trainer: Any, always_save: bool = False) -> None:
        self.trainer = trainer
        self.always_save = always_save
        """``--enable_jit_checkpoint``: save whatever the prediction says (the user asked for a save on SIGTERM)."""
        self.grace_s: float = trainer.elixir_plugin.preempt_grace_s
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
        self._start()

    def _start(self) -> None:
        self.signal: str | None = None
        self.signalled_at = 0.0
        self.stopping = False
        """Every rank agreed to stop at this step's end."""
        self.signals = ""
        """Which rank got which signal (``SIGTERM on rank 1``), once the ranks agreed to stop."""
        self.preempted: str | None = None
        """How the run ended, once it did: the signals and the checkpoint (or none) it left."""
        self.decided: tuple[float, float] | None = None
        """Once the ranks agreed to stop at a step's end: (the save's predicted seconds, the grace left), the job's."""
        self.saved: tuple[float, float] | None = None
        """The preemption's checkpoint, on this rank: (seconds writing it, from the step's end; seconds verifying it)."""
        self._save_from: float | None = None
        self._save_s = 0.0
        self._save_bytes: int | None = None

    # ------------------------------------------------------------------ the signals
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._start()
        if threading.current_thread() is not threading.main_thread():
            logger.warning("elixir: train() runs outside the main thread: no preemption save on SIGTERM/SIGUSR1")
            return
        self._previous = {s: signal.signal(s, self._signalled) for s in SIGNALS}
        _shield_forks()
        global _shielding
        _shielding += 1

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self.release()

    def release(self) -> None:
        """The signals' own handlers back, children no longer shielded: at ``train()``'s end, also a failed one."""
        global _shielding
        if self._previous:
            _shielding -= 1
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        """Runs in the main thread between two bytecodes: records only (no logging, no I/O)."""
        if self.signal is None:
            self.signal, self.signalled_at = signal.Signals(signum).name, time.monotonic()
            engine_state(self.trainer.model).runtime.lockstep.request_stop()

    # ------------------------------------------------------------------ the step's end
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._save_from = time.monotonic()
        if self.stopping or not engine_state(self.trainer.model).runtime.lockstep.stop_requested:
            return
        self.stopping = True
        control.should_training_stop = True
        control.should_evaluate = False
        everyone = _gather((self.signal, self._grace_left(), self._predicted_s()))
        self.signals = who = _who(name for name, _, _ in everyone)
        left, predicted = min(e[1] for e in everyone), max(e[2] for e in everyone)
        self.decided = (predicted, left)
        control.should_save = predicted <= left or self.always_save
        if control.should_save:
            _say(
                state,
                f"elixir: {who} at step {state.global_step}: saving checkpoint-{state.global_step} (predicted "
                f"{predicted:.1f} s, {left:.1f} s of the {self.grace_s:g} s grace left), then exiting with status "
                f"{EXIT_PREEMPTED}",
            )
            return
        newest = newest_complete(self.trainer._get_output_dir(trial=None), required=False)
        self.preempted = f"{who}, without a new checkpoint (a resume takes the newest complete one: {newest})"
        _say(
            state,
            f"elixir: {who} at step {state.global_step}: no checkpoint: saving is predicted to take {predicted:.1f} s "
            f"and {left:.1f} s of the {self.grace_s:g} s grace are left (preempt_grace_s, ELIXIR_PREEMPT_GRACE_S). "
            f"To save on preemption, give it a longer grace, and the launcher too (torchrun --shutdown_timeout, "
            f"SLURM --signal=USR1@SECONDS)",
        )

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._save_from = time.monotonic()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._save_from = time.monotonic()
        if self.stopping:  # the Trainer's end-of-epoch save and evaluation: not after a preemption
            control.should_save = control.should_evaluate = False

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        folder = os.path.join(self.trainer._get_output_dir(trial=None), f"checkpoint-{state.global_step}")
        written = time.monotonic() - self._save_from if self._save_from is not None else 0.0
        if self._save_from is not None:
            self._save_s = max(self._save_s, written)
            self._save_bytes = _checkpoint_bytes(folder)
        if not self.stopping:  # a signal during this save: every rank stops after it
            signals = _gather(self.signal)
            if not any(signals):
                return
            self.signals = _who(signals)
            self.stopping = True
            control.should_training_stop = True
        started = time.monotonic()
        verify(folder, args.process_index, args.should_save)
        self.saved = (written, time.monotonic() - started)
        self.preempted = f"{self.signals}, with {folder} complete and verified ({self.saved[1]:.1f} s)"

    # ------------------------------------------------------------------ the end
    def exit_if_preempted(self) -> None:
        """After ``train()`` returned: a preempted run ends its process here."""
        if self.preempted is not None:
            _say(
                self.trainer.state,
                f"elixir: preempted by {self.preempted}: exit status {EXIT_PREEMPTED}; resume with "
                "resume_from_checkpoint=True",
            )
            raise SystemExit(EXIT_PREEMPTED)

    # ------------------------------------------------------------------ the prediction
    def _grace_left(self) -> float:
        return self.grace_s - (time.monotonic() - self.signalled_at if self.signal else 0.0)

    def _predicted_s(self) -> float:
        size = self._save_bytes if self._save_bytes is not None else _estimated_bytes(self.trainer.model)
        return (self._save_s or size / WRITE_RATE) + size / VERIFY_RATE


def _who(signals: Iterable[str | None]) -> str:
    """``SIGTERM on rank 1``, from every rank's signal (``None``: none), in rank order."""
    return ", ".join(f"{name} on rank {r}" for r, name in enumerate(signals) if name)


def _say(state: TrainerState, message: str) -> None:
    """A warning of the main process (every rank agrees: one says it)."""
    if state.is_world_process_zero:
        logger.warning(message)


def _checkpoint_bytes(folder: str) -> int | None:
    try:
        marker = read_marker(folder)
    except (CheckpointError, OSError):  # verify() names it
        return None
    return sum(entry["bytes"] for entry in marker["files"].values()) if marker is not None else None


def _estimated_bytes(model: nn.Module) -> int:
    params = list(model.parameters())
    return 4 * sum(p.numel() for p in params) + 12 * sum(p.numel() for p in params if p.requires_grad)
