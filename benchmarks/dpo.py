"""Preference training's throughput: TRL's ``DPOTrainer`` under ``--elixir auto`` beside the stock one, in one call.

    PYTHONPATH=src python -m benchmarks.dpo --model llama3-8b --batch 4 --prompt 512 --completion 511 \\
        --systems elixir,elixir_8bit,dpo_lossy --out /tmp/dpo.json --md /tmp/dpo.md
    PYTHONPATH=src python -m benchmarks.dpo --model tiny-llama/config.json --device cpu --systems elixir,dpo \\
        --batch 2 --prompt 8 --completion 7 --steps 2 --warmup 1          # a CPU check

Every system trains the same policy (the model built from its config, transformers' init drawn with seed 0)
against a reference model equal to it, given to the trainer (``ref_model``), on ``--batch`` pairs a step of a
``--prompt``-token prompt and ``--completion``-token chosen and rejected answers (a word-level tokenizer built
here, one token a word: each sequence is exactly ``prompt + completion + 1`` tokens with the EOS). Activation
checkpointing on, bf16 on a GPU, the Trainer's AdamW hyper-parameters of ``benchmarks.harness``, clip 1.0:

- ``elixir`` / ``elixir_8bit``: ``elixir_trainer(DPOTrainer)`` with ``--elixir auto`` (``moments: "8bit"``); the
  reference on an engine of frozen chunks (``elixir_hf.reference``, ``reference_offload`` as ``--reference-offload``);
- ``dpo_lossy``: the stock ``DPOTrainer`` over bf16 weights with ``optim="paged_adamw_8bit"`` (bitsandbytes), the
  reference in bf16 on the GPU: the usual one-GPU full fine-tune;
- ``dpo``: the stock ``DPOTrainer`` over fp32 weights and the Trainer's AdamW (exact; where it fits).

Each system runs in a process of its own. A step is the Trainer's loop from one ``on_step_end`` to the next.
Model FLOPs a step: the policy's forward, recompute and backward (8 x params a token) and the reference's
forward (2 x params a token) over ``2 x batch`` sequences. Prints one JSON document and a table; ``--out``
and ``--md`` write them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("elixir", "elixir_8bit", "dpo_lossy", "dpo")
BASELINE = "dpo_lossy"
FLOPS_PER_TOKEN = {"policy": 8, "reference": 2}
"""Model FLOPs per parameter a token: the policy's forward, recompute and backward; the reference's forward."""


def tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` ids (two- and three-letter words), one token a word."""
    import itertools
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    letters = string.ascii_lowercase
    words = itertools.chain(
        ("".join(p) for p in itertools.product(letters, repeat=2)),
        ("".join(p) for p in itertools.product(letters, repeat=3)),
    )
    vocabulary = [*specials, *itertools.islice(words, vocab - len(specials))]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, "<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def pairs(tok, n: int, prompt: int, completion: int, seed: int = 0):
    """``n`` preference pairs of random words: a ``prompt``-word prompt, ``completion``-word answers."""
    from datasets import Dataset

    words = [w for w in tok.get_vocab() if w.isalpha()]
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    rows = [(text(prompt), text(completion), text(completion)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def run_system(args: argparse.Namespace) -> dict[str, Any]:
    """One system's run, in this process: its record."""
    from trl import DPOConfig, DPOTrainer

    from elixir_hf import elixir_args, elixir_trainer

    from .harness import LR, MAX_GRAD_NORM, WEIGHT_DECAY
    from .hf_systems import StepClock
    from .hostmem import GIB, HostMemorySampler
    from .models import build_initialised_in_place, build_meta, materialize, param_count, preset, vocab_size

    device = torch.device(args.device)
    p = preset(args.model)
    seq = args.prompt + args.completion + 1
    tok = tokenizer(min(vocab_size(p), 20000))
    elixir = args.system.startswith("elixir")
    steps = args.warmup + args.steps
    sampler = HostMemorySampler().start()
    t0 = time.perf_counter()
    if elixir:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        policy, reference = (build_initialised_in_place(p, seq, dtype) for _ in range(2))
    else:
        dtype = torch.bfloat16 if args.system == "dpo_lossy" and device.type == "cuda" else torch.float32
        policy, reference = (materialize(build_meta(p, seq, dtype), device, device) for _ in range(2))
    build_s = time.perf_counter() - t0
    fields: dict[str, Any] = dict(
        per_device_train_batch_size=args.batch,
        max_steps=steps,
        max_length=seq,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        dataset_num_proc=None,
    )
    if args.system == "dpo_lossy":
        fields["optim"] = "paged_adamw_8bit"
    clock = StepClock(device)
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as out_dir:
        if elixir:
            spec: dict[str, Any] = {"reference_offload": args.reference_offload}
            if args.system == "elixir_8bit":
                spec["moments"] = "8bit"
            cls, config = (
                elixir_trainer(DPOTrainer),
                elixir_args(DPOConfig)(output_dir=out_dir, elixir=json.dumps(spec) if spec else "auto", **fields),
            )
        else:
            cls, config = DPOTrainer, DPOConfig(output_dir=out_dir, **fields)
        trainer = cls(
            model=policy,
            ref_model=reference,
            args=config,
            train_dataset=pairs(tok, args.batch * steps, args.prompt, args.completion),
            processing_class=tok,
            callbacks=[clock],
        )
        start = clock.now()
        trainer.train()
    sampler.sample()
    times = clock.times[args.warmup :]
    step_s = statistics.median(times)
    params = param_count(p, seq)
    tokens = 2 * args.batch * seq  # chosen and rejected, each prompt + answer
    flops = sum(FLOPS_PER_TOKEN.values()) * params * tokens
    logs = [e for e in trainer.state.log_history if "loss" in e]
    rec: dict[str, Any] = dict(
        system=args.system,
        model=args.model,
        params=params,
        batch=args.batch,
        seq=seq,
        prompt=args.prompt,
        completion=args.completion,
        status="ok",
        step_s=step_s,
        step_times_s=times,
        pairs_per_s=args.batch / step_s,
        tokens_per_s=tokens / step_s,
        tflops=flops / step_s / 1e12,
        losses=[e["loss"] for e in logs],
        margins=[e.get("rewards/margins") for e in logs],
        build_s=build_s,
        engine_build_s=clock.first_begin - start,
        weights_dtype=str(dtype).removeprefix("torch."),
        host_rss_peak_GiB=sampler.peak_rss / GIB,
        host_used_peak_GiB=sampler.peak_used / GIB,
        card=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )
    if device.type == "cuda":
        rec["gpu_alloc_peak_GiB"] = torch.cuda.max_memory_allocated(device) / GIB
    if elixir:
        plan, ref_plan = trainer.model._elixir.plan, trainer.ref_model._elixir.plan
        rec.update(
            predicted_policy_step_s=plan.predicted_step_s,
            plan=dict(
                offloaded_chunks=f"{len(plan.offload)}/{len(plan.chunks)}",
                moments=plan.moments,
                reference_offloaded_chunks=f"{len(ref_plan.offload)}/{len(ref_plan.chunks)}",
            ),
        )
    return rec


def table(records: list[dict[str, Any]]) -> str:
    """The runs as a markdown table, each against ``BASELINE`` where it ran."""
    base = next((r for r in records if r["system"] == BASELINE and r["status"] == "ok"), None)
    lines = [
        "| card | model | system | batch (pairs) | seq | step s | pairs/s | TFLOPS | vs dpo_lossy | GPU peak GiB | host RSS GiB | first loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["status"] != "ok":
            lines.append(
                f"| {r.get('card', '?')} | {r['model']} | {r['system']} | {r['batch']} | – | {r['status']}: {r.get('error', '')[:80]} |||||||"
            )
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "–"
        lines.append(
            f"| {r['card']} | {r['model']} | {r['system']} | {r['batch']} | {r['seq']} | {r['step_s']:.2f} | "
            f"{r['pairs_per_s']:.2f} | {r['tflops']:.1f} | {ratio} | {r.get('gpu_alloc_peak_GiB', 0):.1f} | "
            f"{r['host_rss_peak_GiB']:.1f} | {r['losses'][0]:.4f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="a preset of elixir_hf.presets or a config.json")
    p.add_argument("--systems", default="elixir,dpo_lossy", help=f"comma-separated: {', '.join(SYSTEMS)}")
    p.add_argument("--system", help=argparse.SUPPRESS)  # a worker's one system
    p.add_argument("--batch", type=int, default=4, help="preference pairs a step (per GPU)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--completion", type=int, default=511, help="tokens of each answer (before its EOS)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="steps run before the timed ones")
    p.add_argument("--reference-offload", type=float, default=1.0, help="Elixir: share of reference chunks on the host")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worker-timeout", type=float, default=900.0, help="seconds a system may run")
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--md", type=Path, help="write the table here")
    args = p.parse_args(argv)
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


def _worker(args: argparse.Namespace, argv: list[str], system: str) -> dict[str, Any]:
    """``system`` in a process of its own (``argv``: this call's arguments): its record, or how it failed."""
    cmd = [sys.executable, "-m", "benchmarks.dpo", *argv, "--system", system]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "model": args.model, "batch": args.batch, "status": "timeout"}
    sys.stderr.write(done.stderr[-4000:])
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode == 0 and found:
        return json.loads(found[-1].removeprefix("RESULT "))
    status = "OOM" if "OutOfMemoryError" in done.stderr else f"exit {done.returncode}"
    return {"system": system, "model": args.model, "batch": args.batch, "status": status, "error": done.stderr[-300:]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.system:
        print("RESULT " + json.dumps(run_system(args)), flush=True)
        return
    records = [_worker(args, argv, s) for s in args.systems.split(",")]
    doc = {"command": "python -m benchmarks.dpo " + " ".join(argv), "runs": records}
    text = table(records)
    print(json.dumps(doc, indent=1))
    print(text)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.md:
        args.md.write_text(text + "\n")
    if any(r["status"] != "ok" for r in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
