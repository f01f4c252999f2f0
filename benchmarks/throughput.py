"""Training throughput of Elixir and the baselines on the same card(s), in one call.

    PYTHONPATH=src python -m benchmarks.throughput --model 6.5b --batch-sizes 4,8 --gpus 1 \\
        --systems elixir,plain,fsdp2,fsdp2_offload,ds2_offload,ds3_offload [--out docs/benchmarks/results.json]
    PYTHONPATH=src python -m benchmarks.throughput --model llama3-8b,qwen2.5-7b --batch-sizes 4 \\
        --systems elixir,fsdp2_offload,ds2_offload,ds3_offload      # seq 2048, clip 1.0: Trainer defaults
    PYTHONPATH=src python -m benchmarks.throughput --model llama2-13b --batch-sizes 4 \\
        --systems elixir_trainer,trainer      # the user's path: Trainer.train() with and without --elixir auto
    PYTHONPATH=src python -m benchmarks.throughput --model llama3-8b,llama2-13b --batch-sizes 4,8 --liger \\
        --systems elixir_trainer,trainer,trainer_lossy,torchao_offload,torchao_offload_bf16   # + Liger's kernels

``--model``: GPT-2 presets (seq 1024), the other presets of ``elixir_hf.presets`` (``llama3-8b``,
``qwen2.5-7b``, the SFT recipes' ``llama3.1-8b``, ``qwen2.5-14b``, ``mistral-7b-v0.3``, ...: seq 2048) or
any HF decoder's ``config.json`` / model folder, random init. ``--clip 1`` (default) clips every system's
gradients to a global norm of 1.0, as the HF Trainer does by default; ``--clip 0`` does not (the older GPT-2 rows).
``--lean-loss 1`` (default) gives Elixir's model the lean causal-LM loss, as ``ElixirTrainer`` does
(``elixir_hf/loss.py``); the baselines keep transformers' own (recorded as ``info.lean_loss``).
``--liger`` sets ``use_liger_kernel=True`` in the Trainer-path systems (``harness.TRAINER_SYSTEMS``;
recorded as ``liger`` and ``info.liger``): a run with it is a row of its own in the tables. ``--compile``
sets ``torch_compile=True`` in the same systems (``compile``; Elixir's ``elixir/compile_s``,
``elixir/compile_graphs`` and ``elixir/compile_graph_breaks`` in ``info.trainer_log``), a row of its own too.

Each system runs in its own worker process (torchrun for several GPUs), so an OOM, a hang or a
host OOM-kill of one cannot take down the others; a worker past ``--worker-timeout`` is killed
and reported as such; a system whose package is not installed (``harness.packages``) is an n/a row
without one. Elixir gets one worker per batch size, because its auto plan is made for
the batch it is prepared with. Results are merged into ``--out`` after every worker, so a call
cut short keeps what finished; the markdown table and chart are written at the end.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from elixir_hf.presets import canonical_name

from . import report
from ._worker import clip_fields
from .harness import (
    MAX_GRAD_NORM,
    STOCK_TRAINERS,
    SYSTEMS,
    TRAINER_SYSTEMS,
    not_installed,
    on_trainer_path,
    packages,
)
from .models import DECODER_PRESETS, PRESETS, param_count, preset

REPO = Path(__file__).resolve().parents[1]
PER_BATCH_SYSTEMS = ("elixir", *TRAINER_SYSTEMS)
"""One worker per batch size: a plan made for its batch, a Trainer (and its optimizer) per process."""
TERM_GRACE_S = 60
"""torchrun needs time after SIGTERM to stop its workers; only then is the group killed."""


def gpu_info() -> dict[str, Any]:
    """Card, driver and memory from nvidia-smi (no CUDA context in this process: the workers need the GPU)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        name, driver, mib = (x.strip() for x in out.splitlines()[0].split(","))
        return {"card": name, "driver": driver, "gpu_total_GiB": float(mib) / 1024}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"card": "cpu", "driver": None, "gpu_total_GiB": 0.0}


def worker_command(args: argparse.Namespace, system: str, model: str, batch_sizes: list[int]) -> list[str]:
    worker = [
        "-m",
        "benchmarks._worker",
        "--system",
        system,
        "--model",
        model,
        "--batch-sizes",
        ",".join(map(str, batch_sizes)),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seq",
        str(args.seqs[model]),
        "--clip",
        str(args.clip),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--ds-pin",
        str(args.ds_pin),
        "--ds-ratio",
        str(args.ds_ratio),
        "--skip-nonfinite",
        str(args.skip_nonfinite),
        "--device-lane",
        args.device_lane,
        "--lean-loss",
        str(args.lean_loss),
        *(["--liger"] if args.liger else []),
        *(["--compile"] if args.compile else []),
    ]
    if args.gpus == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}", *worker]


def worker_env(threads: int) -> dict[str, str]:
    """torchrun would set OMP_NUM_THREADS=1, starving CPU Adam: give each rank its share of the cores."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def run_worker(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, list[dict], list[str]]:
    """Streams the worker's output here; returns (exit code or None on timeout, its records, its last lines)."""
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    records: list[dict] = []
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip())
            records.extend(report.parse_results(line))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        _stop(proc)
    reader.join(timeout=10)
    return rc, records, list(tail)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (torchrun forwards it), then SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def failure(rc: int | None, tail: list[str], timeout_s: float) -> tuple[str, str]:
    """(status, error) for batch sizes a worker never reported."""
    if rc is None:
        return "timeout", f"worker killed after {timeout_s:.0f}s"
    last = next((line for line in reversed(tail) if line.strip()), "")
    killed = rc in (-9, 137) or any("SIGKILL" in line for line in tail)  # torchrun reports its ranks' signals
    hint = " (SIGKILL: likely the host's OOM killer)" if killed else ""
    return "crashed", f"worker exit {rc}{hint}: {last}"[:400]


def _absent(system: str, liger: bool) -> str | None:
    """Why ``system`` cannot run for a package not installed (found before a worker is started for it)."""
    needed = packages(STOCK_TRAINERS.get(system), on_trainer_path(system, liger))
    gone = [package for module, package in needed if importlib.util.find_spec(module) is None]
    return not_installed(gone[0], "not found") if gone else None


def run_system(
    args: argparse.Namespace, system: str, model: str, gpu: dict[str, Any], env: dict[str, str]
) -> list[dict]:
    """Records of one system on one model for every batch size, failures included."""
    groups = [[b] for b in args.batch_sizes] if system in PER_BATCH_SYSTEMS else [args.batch_sizes]
    absent = _absent(system, args.liger)
    records: list[dict] = []
    for group in groups:
        rc, got, tail = (
            (None, [], [])
            if absent
            else run_worker(worker_command(args, system, model, group), env, args.worker_timeout)
        )
        missing = [b for b in group if b not in {r["batch"] for r in got}]
        if missing:
            status, error = ("unavailable", absent) if absent else failure(rc, tail, args.worker_timeout)
            seq = args.seqs[model]
            params = param_count(preset(model), seq)
            got += [
                {
                    "system": system,
                    "model": model,
                    "params": params,
                    "gpus": args.gpus,
                    "batch": b,
                    "seq": seq,
                    **clip_fields(bool(args.clip)),
                    "liger": on_trainer_path(system, args.liger),
                    "compile": on_trainer_path(system, args.compile),
                    **gpu,
                    "status": status,
                    "error": error,
                }
                for b in missing
            ]
        records += got
    return records


def print_summary(results: dict[str, Any], card: str, models: list[str], gpus: int, clip: bool) -> None:
    for key in ("offload_regime", "in_gpu_regime"):
        for row in results[key]:
            if row["card"] == card and row["model"] in models and row["gpus"] == gpus and row["clip"] == clip:
                cells = [
                    f"{s} {v:.1f}" if v is not None else f"{s} {row['status'][s]}" for s, v in row["tflops"].items()
                ]
                ratio = row["elixir_over_best_baseline"]
                best = f" | elixir/best {ratio:.2f}x ({row['best_baseline']})" if ratio is not None else ""
                head = f"{key:15s} {row['model']:9s} x{gpus} seq {row['seq']} bs {row['batch']:3d} clip {int(clip)}"
                head += f" {row['kernels']}" if row["kernels"] != "off" else ""
                print(f"{head}: " + ", ".join(cells) + best, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        required=True,
        help=f"comma-separated presets ({', '.join((*PRESETS, *DECODER_PRESETS))}) "
        "or paths to an HF decoder's config.json / model folder (random init)",
    )
    ap.add_argument("--batch-sizes", required=True, help="comma-separated, per GPU")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    ap.add_argument("--out", type=Path, default=report.DEFAULT_OUT)
    ap.add_argument(
        "--md", type=Path, default=None, help="default: docs/benchmarks.md, or benchmarks.md beside a non-default --out"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="default: 1024 for GPT-2 presets, 2048 for the others")
    ap.add_argument(
        "--clip",
        type=int,
        default=1,
        choices=(0, 1),
        help=f"clip gradients to a global norm of {MAX_GRAD_NORM} (the HF Trainer's default max_grad_norm) in every system",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: smoke tests only")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / GPUs)")
    ap.add_argument(
        "--ds-pin",
        type=int,
        default=1,
        choices=(0, 1),
        help="DeepSpeed pin_memory (0: pageable; pinned OOM-killed a 126 GiB host on the 6.5B)",
    )
    ap.add_argument(
        "--ds-ratio", type=float, default=0.5, help="ds3_partial: DeepSpeed's offload_optimizer.ratio (CPU share)"
    )
    ap.add_argument(
        "--device-lane",
        default="off",
        choices=("off", "on", "auto"),
        help="Elixir's device update lane (ElixirConfig.device_assisted_update): the GPU updates part of the offloaded chunks",
    )
    ap.add_argument(
        "--skip-nonfinite",
        type=int,
        default=1,
        choices=(0, 1),
        help="Elixir's non-finite step check (ElixirConfig.skip_nonfinite, on by default): a host sync per step",
    )
    ap.add_argument(
        "--lean-loss",
        type=int,
        default=1,
        choices=(0, 1),
        help="Elixir's model gets the lean causal-LM loss, as ElixirTrainer installs it by default "
        "(elixir_hf.loss); the baselines keep transformers' own",
    )
    ap.add_argument(
        "--liger",
        action="store_true",
        help="use_liger_kernel=True (Liger's Triton kernels) in the Trainer-path systems: "
        + ", ".join(TRAINER_SYSTEMS),
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch_compile=True in the Trainer-path systems (Elixir: each decoder layer; the stock Trainer: the model)",
    )
    ap.add_argument("--worker-timeout", type=float, default=420, help="seconds per worker process")
    args = ap.parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.gpus)
    # a config path absolute: the workers run in the repository root
    args.models = [
        m if canonical_name(m) or not Path(m).exists() else str(Path(m).resolve()) for m in args.model.split(",")
    ]
    args.systems = args.systems.split(",")
    args.batch_sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    try:
        args.seqs = {name: args.seq or preset(name).default_seq for name in args.models}
        for name, seq in args.seqs.items():
            preset(name).config(seq)  # a --seq beyond the model's positions fails here
    except ValueError as exc:
        ap.error(str(exc))
    if not 0.0 <= args.ds_ratio <= 1.0:
        ap.error(f"--ds-ratio {args.ds_ratio}: a share of the optimizer states in [0, 1]")
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpu = gpu_info() if args.device == "cuda" else {"card": "cpu", "driver": None, "gpu_total_GiB": 0.0}
    call = {
        "command": "PYTHONPATH=src python -m benchmarks.throughput "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "driver": gpu["driver"],
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    env = worker_env(args.threads)
    runs: list[dict] = []
    for model in args.models:
        for system in args.systems:
            runs += [dict(r, **call) for r in run_system(args, system, model, gpu, env)]
            report.write(runs, args.out, args.md, render=False)
    print_summary(report.write(runs, args.out, args.md), gpu["card"], args.models, args.gpus, bool(args.clip))


if __name__ == "__main__":
    main()
