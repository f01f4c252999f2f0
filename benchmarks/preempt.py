"""A preempted Trainer run on a big model: how long its save takes, whether the checkpoint verified,
how it exits, and that a resume loads it.

    PYTHONPATH=src python -m benchmarks.preempt --model llama3-8b --gpus 2 --out /data/preempt
    PYTHONPATH=src python -m benchmarks.preempt --model tiny --gpus 0 --ranks 2 --seq 64 --out /tmp/p   # CPU check

Two ``torchrun`` jobs of ``ElixirTrainer`` with ``--elixir auto`` over the model built from its config
on ``meta``, its init drawn in each rank's shards (bf16 on GPUs; ``benchmarks/models.py``, no download):

1. the run: ``--steps`` steps; SIGTERM to every rank (as ``torchrun`` and SLURM forward it; ``--signal-rank``
   for one) from inside step ``--signal-at``'s forward. The lockstep check-in of the next forward carries
   it, so every rank ends step ``--signal-at + 1``, writes ``checkpoint-N`` if the predicted save fits the
   grace (``--grace``, as ``ELIXIR_PREEMPT_GRACE_S``), verifies it and exits 75;
2. the resume: the same arguments with ``resume_from_checkpoint=True``, to ``--steps``.

``--phase run`` or ``--phase resume`` runs one of them (the resume reads ``--out``'s checkpoint).

Prints one JSON object on stdout (the jobs' output goes to stderr): per rank of the run, its exit
status, the seconds from its signal to the end of the step it stopped after, the save's seconds
(writing, from that step's end; verifying: every file's size and CRC-32), the predicted save and the
grace left, its peak resident memory; the checkpoint, its bytes and their rate over the slowest rank's
save; per rank of the resume, its exit status, the step it resumed at, the seconds from ``train()`` to
its first step (building the engine, verifying and loading the checkpoint) and its losses.

Host memory: the save copies each rank's GPU-resident Adam state to the host at once
(``named_state``), up to 12 bytes a parameter over the ranks (96 GB for Llama-3-8B kept on 2 GPUs),
beside rank 0's copy of the weights (16 GB): a 128 GiB host is tight, ``peak_rss_GB`` shows it.

The checkpoint holds the weights in their dtype and the Adam state (fp32 master, two moments): 14 bytes
a parameter in bf16, 112 GB for Llama-3-8B. A disk with less free space than that is refused up front.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .harness import LR, MAX_GRAD_NORM, WEIGHT_DECAY
from .hostmem import peak_rss_bytes
from .models import build_meta, count_params, preset

REPO = Path(__file__).resolve().parents[1]
EXIT_PREEMPTED = 75  # elixir_hf.preemption.EXIT_PREEMPTED; the driver does not import the Trainer stack


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="a preset of benchmarks/models.py, or a config.json")
    ap.add_argument("--gpus", type=int, default=2, help="ranks, a GPU each; 0: on the CPU (gloo), --ranks of them")
    ap.add_argument("--ranks", type=int, default=2, help="ranks on the CPU (with --gpus 0)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, at most 2048)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--signal-at", type=int, default=2, help="the step during whose forward the signal comes")
    ap.add_argument("--signal-rank", default="all", help="'all', or the one rank signalled")
    ap.add_argument("--grace", type=float, default=1800.0, help="preempt_grace_s: seconds a save may take")
    ap.add_argument("--out", required=True, help="the run's output_dir (the checkpoint is written there)")
    ap.add_argument(
        "--phase", choices=("both", "run", "resume"), default="both", help="one job only (each within a time limit)"
    )
    ap.add_argument("--worker", choices=("run", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 1 <= args.signal_at <= args.steps - 2:
        ap.error(
            f"--signal-at {args.signal_at}: pass 1 to --steps - 2 ({args.steps - 2}): the run stops one step later"
        )
    return args


# --------------------------------------------------------------------------- the driver


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    ranks = args.gpus or args.ranks
    if args.gpus and torch.cuda.device_count() < args.gpus:
        sys.exit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    out = Path(args.out)
    params = count_params(build_meta(preset(args.model), args.seq))
    if args.phase != "resume":
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        needed = params * (2 if args.gpus else 4) + 12 * params
        free = shutil.disk_usage(out).free
        if free < needed * 1.05:
            sys.exit(
                f"--out {out}: its disk has {free / 1e9:.1f} GB free and the checkpoint of {args.model} needs "
                f"{needed / 1e9:.1f} GB (weights and Adam state): pass --out on a disk with more room"
            )
    elif not any(out.glob("checkpoint-*")):
        sys.exit(f"--phase resume: {out} holds no checkpoint; run --phase run (or both) with this --out first")
    report: dict[str, Any] = {"model": args.model, "params": params, "ranks": ranks, "device": _device(args)}
    for phase in ("run", "resume") if args.phase == "both" else (args.phase,):
        started = time.monotonic()
        proc = subprocess.run(_command(args, ranks, phase), cwd=REPO, env=_env(args, ranks), stdout=sys.stderr)
        report[phase] = {
            "torchrun_exit": proc.returncode,
            "wall_s": round(time.monotonic() - started, 1),
            "ranks": [_read(out / f"{phase}-rank{r}.json") for r in range(ranks)],
        }
    saves = [r["save"] for r in report.get("run", {"ranks": []})["ranks"] if r and r.get("save")]
    if saves:
        folder = Path(saves[0]["checkpoint"])
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        slowest = max(s["write_s"] for s in saves)
        report["checkpoint"] = {"folder": str(folder), "bytes": size, "save_GBps": round(size / slowest / 1e9, 2)}
    print(json.dumps(report, indent=1))


def _device(args: argparse.Namespace) -> str:
    return f"{args.gpus}x {torch.cuda.get_device_name(0)}" if args.gpus else f"cpu ({args.ranks} ranks)"


def _command(args: argparse.Namespace, ranks: int, phase: str) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    own = [
        *("--model", args.model, "--gpus", str(args.gpus), "--batch", str(args.batch), "--steps", str(args.steps)),
        *("--signal-at", str(args.signal_at), "--signal-rank", args.signal_rank, "--grace", str(args.grace)),
        *("--out", args.out, "--worker", phase, *(("--seq", str(args.seq)) if args.seq else ())),
    ]
    return [*launch, "-m", "benchmarks.preempt", *own]


def _env(args: argparse.Namespace, ranks: int) -> dict[str, str]:
    """The CPU Adam gets each rank's share of the cores (torchrun would set OMP_NUM_THREADS=1)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))
    env["ELIXIR_PREEMPT_GRACE_S"] = str(args.grace)
    env.pop("ELIXIR_CONFIG", None)
    if not args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------- a rank


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import TrainerCallback

    from elixir_hf import ElixirTrainer, ElixirTrainingArguments

    from .models import build_initialised_in_place

    cuda = args.gpus > 0
    seq = args.seq or preset(args.model).default_seq
    model = build_initialised_in_place(preset(args.model), seq, torch.bfloat16 if cuda else torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (64, seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    fields = dict(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        bf16=cuda,
        use_cpu=not cuda,
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = ElixirTrainer(model=model, args=ElixirTrainingArguments(elixir="auto", **fields), train_dataset=data)
    rank = trainer.args.process_index
    record: dict[str, Any] = {"rank": rank, "exit": 0}

    class Probe(TrainerCallback):
        """The signal from inside step ``--signal-at``'s forward (run); the first step's start (resume)."""

        def on_train_begin(self, a, state, control, model=None, **kw):
            if args.worker == "run" and args.signal_rank in ("all", str(rank)):
                block = model.model.layers[-1] if hasattr(model, "model") else model.transformer.h[-1]
                block.register_forward_pre_hook(lambda *_: _signal(state.global_step + 1))

        def on_step_begin(self, a, state, control, **kw):
            record.setdefault("first_step", (state.global_step + 1, time.time()))

        def on_step_end(self, a, state, control, **kw):
            record["last_step_end"] = time.time()

    def _signal(step: int) -> None:
        if step == args.signal_at and "signalled" not in record:
            record["signalled"] = time.time()
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.add_callback(Probe())
    record["train_called"] = time.time()
    try:
        trainer.train(resume_from_checkpoint=args.worker == "resume")
    except SystemExit as stop:
        record["exit"] = stop.code
        raise
    except BaseException as exc:
        record.update(exit=1, error=f"{type(exc).__name__}: {exc}"[:1000])
        raise
    finally:
        _report(args, trainer, record)
        with open(os.path.join(args.out, f"{args.worker}-rank{rank}.json"), "w") as f:
            json.dump(record, f, indent=1)
        if record["exit"] in (0, EXIT_PREEMPTED):
            dist.barrier()  # every report written before torchrun stops the ranks still running
        if record["exit"] == 0:
            dist.destroy_process_group()


def _report(args: argparse.Namespace, trainer: Any, record: dict[str, Any]) -> None:
    """The rank's record in seconds: the signal to the step's end, the save, the resume's load."""
    step, began = record.pop("first_step", (None, None))
    called, ended = record.pop("train_called", None), record.pop("last_step_end", None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] >= (step or 0)]
    record["train_to_first_step_s"] = _s(called, began)  # the engine's build; on a resume, loading the checkpoint too
    record["peak_rss_GB"] = round(peak_rss_bytes() / 1e9, 1)  # the save copies the GPU-resident Adam state to the host
    if args.worker == "resume":
        record.update(resumed_at=step, losses=losses)
        return
    preemption = trainer._preemption
    signalled = record.pop("signalled", None)
    record.update(
        signalled=signalled is not None,
        signal_to_step_end_s=_s(signalled, ended),
        stopped_after_step=trainer.state.global_step,
        how=preemption.preempted,
        losses=losses,
    )
    if preemption.decided is not None:
        record["predicted_save_s"], record["grace_left_s"] = (round(x, 1) for x in preemption.decided)
    if preemption.saved is not None:
        folder = os.path.join(args.out, f"checkpoint-{trainer.state.global_step}")
        write, verify = preemption.saved
        record["save"] = {
            "checkpoint": folder,
            "write_s": round(write, 1),
            "verify_s": round(verify, 1),
            "verified": True,
        }


def _s(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 2)


if __name__ == "__main__":
    main()
