"""What exact AdamW buys over the lossy one-GPU path: held-out loss after fine-tuning at small learning rates.

A Llama-shape model is pretrained once, then each arm fine-tunes a copy of it on held-out text at
each ``--lrs`` and seed, and the loss on other held-out text is read at the start, at the end and
``--evals`` times between. Only the numerics of the update differ between the arms:

* ``exact``: Elixir, ``ElixirTrainer`` + ``ElixirTrainingArguments(elixir="auto", bf16=True)`` over
  the model in fp32: bf16 compute, fp32 master weights and fp32 AdamW moments (what users run).
* ``elixir_8bit``: as ``exact`` with ``elixir='{"moments": "8bit"}'``: fp32 master weights, the
  update in fp32, block-wise 8-bit moments (``elixir_runtime/adam_state.py``).
* ``bf16_adamw``: bf16 weights, the Trainer's own AdamW (its moments bf16 too, as the weights).
* ``bf16_paged_adamw_8bit``: bf16 weights, bitsandbytes' ``PagedAdamW8bit`` (8-bit moments).
* ``bf16_stochastic_rounding``: bf16 weights, torchao's ``torchao.optim._AdamW(...,
  bf16_stochastic_round=True)`` (the update in fp32, rounded to bf16 at random in proportion).
* ``bf16_kahan``: bf16 weights, torch-optimi's ``optimi.AdamW(..., kahan_sum=True)`` (a bf16
  compensation buffer keeps what rounding the update dropped).

The loop: every arm is the HF ``Trainer.train()`` (the stock ``Trainer`` for the bf16 arms, the
third-party optimizers given as ``optimizers=(optimizer, None)``), with the same arguments: the
Trainer's defaults (betas 0.9/0.999, eps 1e-8, no weight decay, clip to 1.0) and a linear schedule
with 10 % warmup, the same batch and seed. The forward is bf16 in every arm and autocast off in
every arm (the bf16 arms' weights are bf16; the engine computes in bf16 itself). The data order is
the seed's (``data_seed``), the same for every arm; dropout is 0, so the seed sets only the order.

The data: the GPT-2 recipe's offline corpus (``recipes/gpt2/data.py``: Python's standard library,
one document per source file) in three parts of whole documents: C, the recipe's own held-out
split (every 20th document), is the eval text; the rest is split in order into A (the first 70 %),
on which the byte-level BPE is trained and the model pretrained, and B (the remaining 30 %), the
fine-tuning text. Pretraining (seed 0) is plain fp32 AdamW under the stock Trainer (fp32 weights,
bf16 autocast on a GPU, cosine schedule, weight decay 0.1); its weights are saved in bf16, as
released checkpoints are, so every arm starts from the same values (the exact arm upcasts them).

``moved``: the share of the weights' elements whose bf16 value, the one every arm's forward reads,
differs from the pretrained one after fine-tuning. With bf16 weights an update smaller than half
a bf16 spacing is lost, unless rounded stochastically or compensated; fp32 masters keep it until
the sum of such updates moves the bf16 value.

    python -m benchmarks.quality --out quality.json            # GPU: the ``small`` model, every arm
    python -m benchmarks.quality --size tiny --device cpu --steps 8 --seeds 0 --arms exact,bf16_adamw

Prints progress on stderr, then the markdown table and, on the last line, the JSON record
(``--out`` also writes it). An arm whose package is not installed is reported ``not run``; a run
that raises, ``failed`` (the others go on). A benchmark split over several calls (``--arms``,
``--lrs``, ``--seeds``) shares one ``--pretrained`` folder, and ``--merge a.json b.json`` makes
its one table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerBase,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from elixir_hf import ElixirTrainer, ElixirTrainingArguments
from recipes.gpt2 import data

from .models import DecoderModel, causal_lm, count_params

PRETRAIN_SEED = 0
PRETRAIN_SHARE = 0.7
"""Share of the non-held-out documents in part A (pretraining); the rest is B (fine-tuning)."""
WARMUP = 0.1
"""Fine-tuning warmup, a share of ``--steps`` (then linear decay to 0, the Trainer's default)."""
EVAL_BATCH = 4
"""Eval batch, in fine-tuning batches (the loss only: no logits are kept)."""
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Size:
    """A model and corpus scale: the Llama shape, the BPE, the blocks and both phases' batches."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    """Size of the BPE trained on part A; the model's vocabulary is the tokenizer's."""
    seq: int
    batch: int
    """Fine-tuning sequences per step; pretraining takes twice as many."""
    corpus_mb: float | None
    """Megabytes of the recipe's corpus (None: all of it, ~12.6 MB)."""
    pretrain_steps: int
    pretrain_lr: float


SIZES: dict[str, Size] = {
    "tiny": Size(64, 2, 4, 2, 128, 512, 64, 4, 0.3, 60, 3e-3),  # CPU tests: seconds
    # 88M parameters (12.6M of them embeddings); pretraining sees part A about twice
    "small": Size(768, 12, 12, 4, 2048, 8192, 512, 8, None, 600, 6e-4),
}


def _hyper(args: TrainingArguments) -> dict[str, Any]:
    """The Trainer's AdamW hyperparameters, for the optimizers it does not build."""
    return dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )


def _paged_adamw_8bit(params: Iterable[torch.Tensor], args: TrainingArguments) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, **_hyper(args))


def _stochastic_rounding(params: Iterable[torch.Tensor], args: TrainingArguments) -> torch.optim.Optimizer:
    from torchao.optim import _AdamW

    return _AdamW(params, **_hyper(args), bf16_stochastic_round=True)


def _kahan(params: Iterable[torch.Tensor], args: TrainingArguments) -> torch.optim.Optimizer:
    from optimi import AdamW

    return AdamW(params, **_hyper(args), kahan_sum=True)


@dataclass(frozen=True)
class Arm:
    name: str
    title: str
    optimizer: Callable[[Iterable[torch.Tensor], TrainingArguments], torch.optim.Optimizer] | None = None
    """Builds the optimizer over bf16 weights; None: the Trainer's own (Elixir's for ``elixir``)."""
    module: str | None = None
    """The module it imports (None: nothing beyond this package's requirements)."""
    package: str | None = None
    """The distribution that installs ``module``."""
    elixir: str | None = None
    """The arm is ``ElixirTrainer`` over fp32 weights with this ``--elixir`` value; None: the stock Trainer."""


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("exact", "Elixir exact (fp32 master + AdamW)", elixir="auto"),
        Arm(
            "elixir_8bit", "Elixir 8-bit moments (fp32 master + block-wise 8-bit moments)", elixir='{"moments": "8bit"}'
        ),
        Arm("bf16_adamw", "bf16 + AdamW"),
        Arm("bf16_paged_adamw_8bit", "bf16 + paged_adamw_8bit", _paged_adamw_8bit, "bitsandbytes", "bitsandbytes"),
        Arm("bf16_stochastic_rounding", "bf16 + stochastic rounding", _stochastic_rounding, "torchao", "torchao"),
        Arm("bf16_kahan", "bf16 + Kahan summation", _kahan, "optimi", "torch-optimi"),
    )
}


def missing(arm: Arm) -> str | None:
    """``not run: <package> missing`` when the arm's package is not installed, else None."""
    if arm.module is None or importlib.util.find_spec(arm.module) is not None:
        return None
    return f"not run: {arm.package} missing"


def model_config(size: Size, vocab: int) -> LlamaConfig:
    """The Llama shape (RMSNorm, SwiGLU, rope, GQA, untied head) as ``benchmarks.models`` builds it."""
    shape = LlamaConfig(
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        vocab_size=vocab,
        max_position_embeddings=size.seq,
        tie_word_embeddings=False,
    )
    return DecoderModel("quality", shape).config(size.seq)


def corpus(size: Size) -> tuple[PreTrainedTokenizerBase, datasets.DatasetDict]:
    """The recipe's corpus as ``train`` (A), ``finetune`` (B) and ``validation`` (C) blocks of
    ``size.seq`` tokens, with the BPE trained on A (module docstring: which documents go where)."""
    source = SimpleNamespace(
        dataset_name=None,
        train_file=None,
        validation_file=None,
        corpus_mb=size.corpus_mb,
        streaming=False,
        validation_split_percentage=5,
    )
    raw = data.load_raw(source, str(data.cache_dir() / "datasets"))
    rest = raw["train"]
    cut = round(len(rest) * PRETRAIN_SHARE)
    parts = datasets.DatasetDict(
        train=rest.select(range(cut)), finetune=rest.select(range(cut, len(rest))), validation=raw["validation"]
    )
    tokenizer = data.train_tokenizer(parts["train"][data.text_column(parts)], size.vocab, size.seq)
    return tokenizer, data.lm_datasets(parts, tokenizer, size.seq)


def _common_args(device: torch.device, out: Path, batch: int) -> dict[str, Any]:
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=EVAL_BATCH * batch,
        prediction_loss_only=True,
        use_cpu=device.type == "cpu",
        dataloader_pin_memory=device.type == "cuda",
        save_strategy="no",
        report_to="none",
    )


class _Progress(TrainerCallback):
    """Each training log as one line on stderr (the Trainer's own go to stdout, the table's)."""

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            print(f"pretraining step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}", file=sys.stderr)


def pretrain(size_name: str, blocks: datasets.DatasetDict, vocab: int, device: torch.device, out: Path) -> dict:
    """Trains the model on A and saves it in bf16 to ``out``, with ``pretrain.json`` (its record).
    A folder that holds both already is reused (a run split over several calls: ``--pretrained``)."""
    record_file = out / "pretrain.json"
    if (out / WEIGHTS).is_file() and record_file.is_file():
        record = json.loads(record_file.read_text())
        if record["size"] != size_name or record["vocab"] != vocab:
            raise SystemExit(
                f"{out} holds a pretrained {record['size']} (vocab {record['vocab']}): pass another folder"
            )
        print(f"pretrained model reused from {out}", file=sys.stderr, flush=True)
        return record
    size = SIZES[size_name]
    torch.manual_seed(PRETRAIN_SEED)
    model = causal_lm(model_config(size, vocab))
    args = TrainingArguments(
        **_common_args(device, out / "run", 2 * size.batch),
        max_steps=size.pretrain_steps,
        learning_rate=size.pretrain_lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.1,
        adam_beta2=0.95,
        bf16=device.type == "cuda",
        seed=PRETRAIN_SEED,
        logging_steps=max(1, size.pretrain_steps // 10),
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        data_collator=default_data_collator,
        callbacks=[_Progress()],
    )
    trainer.remove_callback(PrinterCallback)
    print(f"pretraining {count_params(model) / 1e6:.1f}M parameters on part A", file=sys.stderr, flush=True)
    start = time.perf_counter()
    result = trainer.train()
    record = {
        "size": size_name,
        "vocab": vocab,
        "params": count_params(model),
        "steps": size.pretrain_steps,
        "batch": 2 * size.batch,
        "lr": size.pretrain_lr,
        "train_loss": result.training_loss,
        "eval_loss": trainer.evaluate()["eval_loss"],
        "wall_s": time.perf_counter() - start,
    }
    model.to(torch.bfloat16).save_pretrained(out)
    record_file.write_text(json.dumps(record, indent=2))
    return record


def moved(end: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """Share of the elements of ``start``'s (bf16) tensors whose value in ``end``, rounded to bf16, differs."""
    changed = sum(int((end[name].cpu().to(torch.bfloat16) != t).sum()) for name, t in start.items())
    return changed / sum(t.numel() for t in start.values())


def finetune(
    arm: Arm, lr: float, seed: int, args: argparse.Namespace, blocks: datasets.DatasetDict, pretrained: Path, out: Path
) -> dict[str, Any]:
    """One arm's fine-tuning on B from the pretrained weights (``args``: the command line's size,
    steps, evals and device): the held-out loss on C over steps (``[step, loss]``, step 0
    included), the mean training loss, the share of weights moved, the time."""
    steps, device = args.steps, torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(
        pretrained, dtype=torch.float32 if arm.elixir else torch.bfloat16, attn_implementation="sdpa"
    )
    fields = dict(
        **_common_args(device, out, SIZES[args.size].batch),
        max_steps=steps,
        learning_rate=lr,
        warmup_steps=WARMUP,
        seed=seed,
        data_seed=seed,
        eval_strategy="steps",
        eval_steps=max(1, steps // (args.evals + 1)),
        eval_on_start=True,
        logging_steps=steps,
        disable_tqdm=True,
    )
    datasets_ = dict(
        train_dataset=blocks["finetune"], eval_dataset=blocks["validation"], data_collator=default_data_collator
    )
    if arm.elixir is not None:
        args = ElixirTrainingArguments(elixir=arm.elixir, bf16=True, **fields)
        trainer: Trainer = ElixirTrainer(model=model, args=args, **datasets_)
    else:
        args = TrainingArguments(**fields)
        optimizer = arm.optimizer(model.parameters(), args) if arm.optimizer is not None else None
        trainer = Trainer(model=model, args=args, optimizers=(optimizer, None), **datasets_)
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    result = trainer.train()
    history = [[e["step"], e["eval_loss"]] for e in trainer.state.log_history if "eval_loss" in e]
    if history[-1][0] != steps:
        history.append([steps, trainer.evaluate()["eval_loss"]])
    wall = time.perf_counter() - start
    share = moved(trainer.model.state_dict(), load_file(pretrained / WEIGHTS))
    return {
        "eval": history,
        "start_eval_loss": history[0][1],
        "final_eval_loss": history[-1][1],
        "train_loss": result.training_loss,
        "moved": share,
        "wall_s": wall,
    }


def table(runs: list[dict[str, Any]], arms: list[Arm], lrs: list[float]) -> str:
    """Arm x lr: the final held-out loss (mean ± sample sd over the seeds), its change from the
    run's own start, the gap to ``exact`` at that lr (``arms`` in ``ARMS``'s order: exact first),
    the weights moved, the seconds per run (evaluations and Elixir's build included)."""
    lines = [
        "| arm | lr | final held-out loss | change from start | gap to exact | weights moved | s / run |",
        "|---|---|---|---|---|---|---|",
    ]
    exact_final: dict[float, float] = {}
    for arm in arms:
        for lr in lrs:
            rows = [r for r in runs if r["arm"] == arm.name and r["lr"] == lr]
            ok = [r for r in rows if r["status"] == "ok"]
            if not rows:  # merged records: this arm did not run at this lr
                continue
            if not ok:
                lines.append(f"| {arm.title} | {lr:g} | {rows[0]['status']} | – | – | – | – |")
                continue
            losses = [r["final_eval_loss"] for r in ok]
            final, sd = statistics.fmean(losses), statistics.stdev(losses) if len(ok) > 1 else 0.0
            if arm.name == "exact":
                exact_final[lr] = final
            change = statistics.fmean(r["final_eval_loss"] - r["start_eval_loss"] for r in ok)
            gap = f"{final - exact_final[lr]:+.4f}" if arm.name != "exact" and lr in exact_final else "–"
            seeds = "" if len(ok) == len(rows) else f" ({len(ok)} of {len(rows)} seeds)"
            share = statistics.fmean(r["moved"] for r in ok)
            wall = statistics.fmean(r["wall_s"] for r in ok)
            lines.append(
                f"| {arm.title} | {lr:g} | {final:.4f} ± {sd:.4f}{seeds} | {change:+.4f} | {gap} | "
                f"{share:.1%} | {wall:.0f} |"
            )
    return "\n".join(lines)


def _versions() -> dict[str, str | None]:
    found = {}
    for name in ("torch", "transformers", "bitsandbytes", "torchao", "torch-optimi"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both phases for the arms asked; the JSON record (``table`` renders its runs)."""
    device, size = torch.device(args.device), SIZES[args.size]
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        raise SystemExit("one GPU: with more the stock Trainer's arms run DataParallel; set CUDA_VISIBLE_DEVICES=0")
    arms = [arm for arm in ARMS.values() if arm.name in args.arms]  # exact first: the others' gaps need it
    skipped = {arm.name: missing(arm) for arm in arms}
    record: dict[str, Any] = {
        "benchmark": "quality",
        "size": args.size,
        "shape": asdict(size),
        "steps": args.steps,
        "evals": args.evals,
        "lrs": args.lrs,
        "seeds": args.seeds,
        "warmup": WARMUP,
        "arms": {arm.name: arm.title for arm in arms},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": sys.version.split()[0],
        "versions": _versions(),
    }
    runs = [
        {"arm": arm.name, "lr": lr, "seed": seed, "status": skipped[arm.name] or "pending"}
        for arm in arms
        for lr in args.lrs
        for seed in args.seeds
    ]
    todo = [r for r in runs if r["status"] == "pending"]
    if todo:
        tokenizer, blocks = corpus(size)
        record["blocks"] = {part: len(split) for part, split in blocks.items()}
        with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
            pretrained = Path(args.pretrained or Path(tmp) / "pretrained")
            record["pretrain"] = pretrain(args.size, blocks, len(tokenizer), device, pretrained)
            for i, r in enumerate(todo, 1):
                label = f"[{i}/{len(todo)}] {r['arm']} lr {r['lr']:g} seed {r['seed']}"
                print(f"{label} ...", file=sys.stderr, flush=True)
                arm = ARMS[r["arm"]]
                try:
                    r.update(finetune(arm, r["lr"], r["seed"], args, blocks, pretrained, Path(tmp) / f"run-{i}"))
                    r["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - the run's row says so; the others go on
                    traceback.print_exc()
                    r["status"] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
                    print(f"{label}: {r['status']}", file=sys.stderr, flush=True)
                else:
                    print(
                        f"{label}: held-out loss {r['start_eval_loss']:.4f} -> {r['final_eval_loss']:.4f}, "
                        f"{r['moved']:.1%} of weights moved, {r['wall_s']:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                if args.out:  # a call cut short (the GPU box's 10-minute limit) keeps the runs it finished
                    Path(args.out).write_text(json.dumps({**record, "runs": runs}) + "\n")
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    record["runs"] = runs
    record["table"] = table(runs, arms, args.lrs)
    return record


def merge(paths: list[str]) -> dict[str, Any]:
    """One record from the records of a benchmark split over several calls (by ``--arms``, ``--lrs``
    or ``--seeds``, sharing one ``--pretrained`` folder): their runs in order, the table over all.
    Their size, steps, evals and pretrained model must agree."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    pretrains = {json.dumps(r["pretrain"], sort_keys=True) for r in records if "pretrain" in r}
    for key in ("size", "steps", "evals", "warmup"):
        if len({json.dumps(r[key]) for r in records}) > 1:
            raise SystemExit(f"{paths} are not one benchmark: their {key!r} differ")
    if len(pretrains) > 1:
        raise SystemExit(f"{paths} are not one benchmark: they fine-tuned different pretrained models")
    runs = [run for r in records for run in r["runs"]]
    names = {name for r in records for name in r["arms"]}
    arms = [arm for arm in ARMS.values() if arm.name in names]
    lrs = sorted({lr for r in records for lr in r["lrs"]})
    merged = {
        **records[0],
        "lrs": lrs,
        "seeds": sorted({seed for r in records for seed in r["seeds"]}),
        "arms": {arm.name: arm.title for arm in arms},
        "device": " + ".join(dict.fromkeys(r["device"] for r in records)),
        "runs": runs,
        "table": table(runs, arms, lrs),
    }
    if pretrains:
        merged["pretrain"] = json.loads(pretrains.pop())
    return merged


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _arms(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown}: pick from {list(ARMS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--size", choices=list(SIZES), default="small" if on_gpu else "tiny", help="default: small on a GPU, else tiny"
    )
    ap.add_argument("--steps", type=int, default=300, help="fine-tuning steps per run")
    ap.add_argument("--evals", type=int, default=5, help="held-out evaluations between the start and the end")
    ap.add_argument("--lrs", type=_floats, default=[1e-5, 2e-5], help="comma-separated")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2], help="comma-separated")
    ap.add_argument("--arms", type=_arms, default=list(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--device", default="cuda" if on_gpu else "cpu")
    ap.add_argument(
        "--pretrained", default=None, help="folder for the pretrained model: reused if it holds one (default: a temp)"
    )
    ap.add_argument("--out", default=None, help="also write the JSON record to this file (after every run)")
    ap.add_argument(
        "--merge", nargs="+", default=None, metavar="JSON", help="run nothing: one record and table from these records"
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.evals < 0:
        ap.error("--steps must be >= 1 and --evals >= 0")
    record = merge(args.merge) if args.merge else run(args)
    print(record["table"], flush=True)
    line = json.dumps(record)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
