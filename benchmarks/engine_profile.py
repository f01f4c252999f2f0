"""Quick single-GPU look at where an Elixir step spends its time, next to plain AMP.

    python -m benchmarks.engine_profile --n-embd 1600 --n-layer 48 --bs 8 --offload 0,0.5 [--trace DIR]

Plain AMP: fp32 params, bf16 autocast, fused AdamW. Elixir: static plan (bf16, given offload,
rCache max unless --min-blocks). Prints step time and TFLOPS (8 · params · tokens / step) per run,
and with --trace writes a torch profiler trace of one Elixir step plus its top CUDA/CPU ops.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

import elixir_runtime as er

SEQ, VOCAB = 1024, 50257


def build(n_embd: int, n_layer: int, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_embd // 64,
        n_positions=SEQ,
        vocab_size=VOCAB,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def timed(step, n: int = 4, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-embd", type=int, default=1600)
    ap.add_argument("--n-layer", type=int, default=48)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--offload", default="0,0.5")
    ap.add_argument("--min-blocks", action="store_true")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--trace", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    ids = torch.randint(0, VOCAB, (a.bs, SEQ), device=dev)
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    if not a.no_plain:
        model = build(a.n_embd, a.n_layer, dev)
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def plain():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()

        dt = timed(plain)
        rows.append(
            {
                "system": "plain",
                "step_s": dt,
                "tflops": 8 * n * a.bs * SEQ / dt / 1e12,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
        model = opt = None  # freed before the next build
        gc.collect()  # the engine's hooks form reference cycles
        torch.cuda.empty_cache()
    for off in [float(x) for x in a.offload.split(",")]:
        torch.cuda.reset_peak_memory_stats()
        model = build(a.n_embd, a.n_layer, dev)
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cfg = er.ElixirConfig(mode="static", dtype="bf16", offload=off, n_blocks="min" if a.min_blocks else "max")
        model, opt = er.prepare(model, opt, cfg, example_batch=batch)

        def elixir(model=model, opt=opt):
            loss = model(**batch).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()

        dt = timed(elixir)
        plan = model._elixir.plan
        rows.append(
            {
                "system": f"elixir offload={off}",
                "step_s": dt,
                "tflops": 8 * n * a.bs * SEQ / dt / 1e12,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "plan_device_gib": plan.device_bytes / 2**30,
                "n_blocks": plan.n_blocks,
                "n_chunks": plan.n_chunks,
                "stats": dict(model._elixir.runtime.stats),
            }
        )
        if a.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                elixir()
                torch.cuda.synchronize()
            prof.export_chrome_trace(f"{a.trace}/elixir_offload{off}.json")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
        model = opt = None  # freed before the next build
        gc.collect()  # the engine's hooks form reference cycles
        torch.cuda.empty_cache()
    print(
        json.dumps(
            {"card": torch.cuda.get_device_name(), "n_embd": a.n_embd, "n_layer": a.n_layer, "bs": a.bs, "rows": rows},
            indent=1,
        )
    )
    for r in rows:
        print(f"{r['system']:24s} {r['step_s']:.3f} s  {r['tflops']:.1f} TFLOPS  peak {r['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
