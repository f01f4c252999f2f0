"""Profiler accuracy on a GPU: predicted activation peak vs ``torch.cuda.max_memory_allocated``.

    PYTHONPATH=src python -m benchmarks.profiler_accuracy [--json] [--out results.json]
        [--models gpt2-xl,gpt2-4b] [--batch-sizes 4,8,16] [--hardware-out hw.json] [--no-timing]

For HF GPT-2 1.5B (``gpt2-xl``) and the paper's GPT2-4b in bf16 with SDPA, seq 1024, batch
4/8/16, activation checkpointing on and off, one training step runs for real and its peak
``max_memory_allocated`` increase over the memory held before the step (weights, batch, cuBLAS
workspace after a warm-up step) is compared with the profiler's prediction. As in the engine,
each gradient is dropped as soon as it is accumulated, so the measured peak is activations plus
transient gradients, which is what the profiler predicts. Two predictions are shown: traced on
fake CUDA tensors (what ``prepare`` does on this machine) and on fake CPU tensors with CUDA's
attention kernels (what ``elixir-plan`` does on a machine without a GPU).

With timing on (default) the machine's hardware profile is measured (and written to
``--hardware-out`` if given) and the measured forward+backward time is shown next to the
profile's predicted compute time. A configuration that does not fit the card reports OOM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from elixir_hf.patches import mask_decisions_of
from elixir_hf.presets import PRESETS, canonical_name
from elixir_runtime.profiler import ModelProfile, profile_model
from elixir_runtime.profiler.kernels import cuda_attention
from elixir_runtime.search.step_time import compute_time

GIB = 2**30
SEQ = 1024
MODELS = ("gpt2-xl", "gpt2-4b")
"""Presets of ``elixir_hf.presets`` (``gpt2-xl``: ``gpt2-1.5b``, the name the results in docs/planning.md use)."""


def build(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_positions=SEQ, vocab_size=50257, **PRESETS[canonical_name(name)][1])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    drop_grads_when_accumulated(model)
    return model


def drop_grads_when_accumulated(model: torch.nn.Module) -> None:
    """Each gradient is dropped once accumulated, as the engine drops it once reduced into its chunk."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_drop_grad)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def step(model: torch.nn.Module, batch: dict) -> None:
    loss = model(**batch).loss
    loss.backward()


def measure(model: torch.nn.Module, batch: dict, timing: bool) -> tuple[int, float | None]:
    """(peak bytes above what the step starts with, seconds per step or None)."""
    step(model, batch)  # warm-up: workspaces and kernels that persist are part of the base
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(model, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    seconds = None
    if timing:
        start = time.perf_counter()
        for _ in range(2):
            step(model, batch)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 2
    return peak, seconds


def predict(model: torch.nn.Module, batch: dict) -> tuple[ModelProfile, ModelProfile, str | None]:
    """(the prediction ``prepare`` makes here, the one ``elixir-plan`` makes without a GPU, and why the
    first fell back to the second, if it did)."""
    with mask_decisions_of(batch):  # as build_engine traces
        with cuda_attention():
            on_cpu = profile_model(model, batch, dtype=torch.bfloat16, device="cpu")
        try:
            return profile_model(model, batch, dtype=torch.bfloat16, device="cuda"), on_cpu, None
        except Exception as exc:  # reported in the row; prepare falls back the same way
            return on_cpu, on_cpu, f"fake-CUDA trace failed: {type(exc).__name__}: {exc}"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rates = None
    if args.timing:
        from elixir_runtime.hardware.measure import measure_hardware

        hardware = measure_hardware()
        if args.hardware_out:
            hardware.save(args.hardware_out)
        rates = hardware.rates(1)
        print(f"hardware: {hardware.device}, {hardware.source}", file=sys.stderr)
    rows = []
    for name in args.models:
        model = build(name)
        for batch_size in args.batch_sizes:
            ids = torch.randint(0, 50257, (batch_size, SEQ), device="cuda")
            batch = {"input_ids": ids, "labels": ids}
            for ac in (True, False):
                set_checkpointing(model, ac)
                row: dict[str, Any] = {"model": name, "batch": batch_size, "ac": ac}
                gpu, cpu, failure = predict(model, batch)
                row["predicted_gib"] = gpu.activation_peak / GIB
                row["predicted_cpu_trace_gib"] = cpu.activation_peak / GIB
                row["peak_at"] = gpu.peak_at
                row["profile_s"] = gpu.seconds
                if failure:
                    row["failure"] = failure
                try:
                    peak, seconds = measure(model, batch, args.timing)
                    row["measured_gib"] = peak / GIB
                    row["error"] = (gpu.activation_peak - peak) / peak
                    row["error_cpu_trace"] = (cpu.activation_peak - peak) / peak
                    if seconds is not None and rates is not None:
                        c = gpu.compute
                        row["step_s"] = seconds
                        row["predicted_compute_s"] = compute_time(c["fwd"], rates) + compute_time(c["bwd"], rates)
                except torch.cuda.OutOfMemoryError:
                    row["measured_gib"] = None
                    row["oom"] = True
                torch.cuda.empty_cache()
                rows.append(row)
                print(_line(row), file=sys.stderr if args.json else sys.stdout, flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


HEADER = (
    f"{'model':<8} {'bs':>3} {'AC':>3} {'pred GiB':>9} {'cpu-trace':>9} {'measured':>9} {'err':>7} {'err cpu':>7}"
    f" {'step s':>7} {'pred comp s':>11}  peak at"
)


def _line(r: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        v = r.get(key)
        return format(v, fmt) if v is not None else "OOM" if r.get("oom") else "-"

    return (
        f"{r['model']:<8} {r['batch']:>3} {'on' if r['ac'] else 'off':>3} {r['predicted_gib']:>9.2f} "
        f"{r['predicted_cpu_trace_gib']:>9.2f} {num('measured_gib', '9.2f'):>9} {num('error', '+7.1%'):>7} "
        f"{num('error_cpu_trace', '+7.1%'):>7} {num('step_s', '7.3f'):>7} {num('predicted_compute_s', '11.3f'):>11}  "
        f"{r['peak_at']}" + (f"  [{r['failure']}]" if r.get("failure") else "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    p.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--hardware-out", help="write the measured hardware profile here")
    p.add_argument("--no-timing", dest="timing", action="store_false", help="skip hardware profile and step timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profiler_accuracy needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}", file=sys.stderr if args.json else sys.stdout)
    print(HEADER, file=sys.stderr if args.json else sys.stdout)
    rows = run(args)
    doc = {"device": device, "torch": torch.__version__, "seq": SEQ, "dtype": "bfloat16", "rows": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    errors = [abs(r["error"]) for r in rows if r.get("error") is not None]
    if errors:
        print(
            f"max |error| {max(errors):.1%} over {len(errors)} measured configurations",
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
