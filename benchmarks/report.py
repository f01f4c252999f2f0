"""Merges per-run records into results.json and renders the markdown table and the bar chart.

    python -m benchmarks.report [INPUT ...] [--out docs/benchmarks/results.json] [--md docs/benchmarks.md]

INPUTs are results.json files of other calls or logs holding ``RESULT {json}`` lines; their runs
replace runs of the same (card, model, GPUs, seq, batch, clip, fused kernels, system) already in ``--out``.
Each summary row compares systems on one card, at one sequence length, one clip and one fused-kernel
setting only: the card changes the regimes (an H200 fits what an H100 cannot), clipping changes what
overlaps, and Liger's kernels and torch.compile change the step of every Trainer-path system.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SYSTEM_ORDER = (
    "elixir",
    "elixir_trainer",
    "elixir_trainer_8bit",
    "plain",
    "trainer",
    "trainer_lossy",
    "torchao_offload",
    "torchao_offload_bf16",
    "fsdp2",
    "fsdp2_offload",
    "ds2_offload",
    "ds3_offload",
)
ELIXIR_SYSTEMS = ("elixir", "elixir_trainer", "elixir_trainer_8bit")
"""Elixir through the harness's own loop and through ``Trainer.train()``: never a baseline; a row's
Elixir figures are the first of these that ran."""
IN_GPU_SYSTEMS = ("plain", "trainer", "fsdp2")
"""Baselines that hold all model states on the GPU: if one of them runs, memory is plentiful."""
STATE_BYTES_PER_PARAM = 16  # fp32 master + grad + Adam m, v
STATE_FRACTION_THAT_FITS = 0.8
"""Above this share of GPU memory, states leave too little for activations and workspace."""
METRIC = "TFLOPS per GPU = 8 * params * tokens per GPU per step / step time (the paper's metric)"
FLOPS_NOTE = (
    "params: every distinct parameter (embeddings and an untied lm_head included); 8 = 2 (forward) + 4 (backward) "
    "+ 2 (the forward recomputed by activation checkpointing) per parameter and token; attention's "
    "score FLOPs (16 * layers * hidden * seq per token with checkpointing) are not counted: one rule for every row. "
    "At seq 2048 they would add 6.7 % for Llama-3-8B and 5.4 % for Qwen2.5-7B, about what counting the input "
    "embedding (a lookup, 6.5 % / 7.2 % of the parameters) adds"
)
DEFAULT_OUT = Path("docs/benchmarks/results.json")
DEFAULT_MD = Path("docs/benchmarks.md")
NOTES_BEGIN = "<!-- hand-written notes: kept when `python -m benchmarks.report` rewrites this file -->"
NOTES_END = "<!-- end of the hand-written notes -->"
"""The markdown between these lines is written by hand (what the numbers mean, their spread, their
history); a rewrite keeps it, before the Runs table."""
CELL = {"OOM": "OOM", "unavailable": "n/a", "timeout": "timeout", "crashed": "crashed", "error": "error"}
PACKAGES = {
    "deepspeed": "DeepSpeed",
    "liger-kernel": "Liger Kernel",
    "bitsandbytes": "bitsandbytes",
    "torchao": "torchao",
}
"""Versions a system records in its ``info`` (by pip name), listed with the machine's in Environment."""

Run = dict[str, Any]


def parse_results(text: str) -> list[Run]:
    """The records of ``RESULT {json}`` lines (anywhere in a line: launchers may prefix it)."""
    runs = []
    for line in text.splitlines():
        _, sep, payload = line.partition("RESULT {")
        if sep:
            runs.append(json.loads("{" + payload))
    return runs


def load_runs(path: Path) -> list[Run]:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text).get("runs", [])
    return parse_results(text)


def clipped(r: Run) -> bool:
    """Whether the run clipped gradients; runs recorded before ``--clip`` existed clipped nothing."""
    return bool(r.get("clip", False))


def ligered(r: Run) -> bool:
    """Whether the run had Liger's kernels (``--liger``); runs recorded before it existed had none."""
    return bool(r.get("liger", False))


def compiled(r: Run) -> bool:
    """Whether the run had ``torch_compile=True`` (``--compile``); runs recorded before it existed had not."""
    return bool(r.get("compile", False))


def kernels(r: Run) -> str:
    """The run's fused-kernel setting, a row of its own: Liger's kernels and torch.compile."""
    on = [name for name, used in (("Liger", ligered(r)), ("compile", compiled(r))) if used]
    return " + ".join(on) or "off"


def run_key(r: Run) -> tuple:
    return (r.get("card"), r["model"], r["gpus"], r.get("seq"), r["batch"], clipped(r), kernels(r), r["system"])


def merge_runs(old: Iterable[Run], new: Iterable[Run]) -> list[Run]:
    """Union by run key; a newer run of the same key replaces the older one."""
    merged = {run_key(r): r for r in old}
    merged.update((run_key(r), r) for r in new)
    return list(merged.values())


def _ok(r: Run | None) -> bool:
    return r is not None and r.get("status") == "ok" and r.get("tflops") is not None


def _pageable(r: Run) -> bool:
    """A DeepSpeed run with pageable host buffers: pinned ones OOM-killed the host on the 6.5B."""
    return r["system"].startswith("ds") and (r.get("info") or {}).get("pin_memory") is False


def regime(runs: dict[str, Run]) -> str:
    """``in_gpu`` when a baseline holding all states on the GPU ran, ``offload`` when one ran out of
    memory; otherwise (none tried, or they failed for other reasons) from the size of the states."""
    tried = [runs[s] for s in IN_GPU_SYSTEMS if s in runs]
    if any(_ok(r) for r in tried):
        return "in_gpu"
    if any(r.get("status") == "OOM" for r in tried):
        return "offload"
    any_run = next(iter(runs.values()))
    states_gib = STATE_BYTES_PER_PARAM * any_run["params"] / any_run["gpus"] / 2**30
    return "offload" if states_gib > STATE_FRACTION_THAT_FITS * any_run.get("gpu_total_GiB", 0.0) else "in_gpu"


def summary_row(runs: dict[str, Run]) -> dict[str, Any]:
    """One (card, model, GPUs, batch): each system's TFLOPS and Elixir over the best baseline that ran."""
    first = next(iter(runs.values()))
    row: dict[str, Any] = {k: first.get(k) for k in ("card", "model", "params", "gpus", "seq", "batch")}
    row["clip"] = clipped(first)
    row["kernels"] = kernels(first)
    row["tflops"] = {s: (r["tflops"] if _ok(r) else None) for s, r in runs.items()}
    row["status"] = {s: r.get("status") for s, r in runs.items()}
    row["pageable"] = sorted(s for s, r in runs.items() if _pageable(r))
    baselines = {s: r["tflops"] for s, r in runs.items() if s not in ELIXIR_SYSTEMS and _ok(r)}
    best = max(baselines, key=baselines.get) if baselines else None
    elixir = next((runs[s] for s in ELIXIR_SYSTEMS if _ok(runs.get(s))), None) or runs.get("elixir")
    row.update(best_baseline=best, best_baseline_tflops=baselines.get(best) if best else None)
    row["elixir_over_best_baseline"] = elixir["tflops"] / baselines[best] if best and _ok(elixir) else None
    if elixir is not None:
        row["elixir_system"] = elixir["system"]
        plan = (elixir.get("info") or {}).get("plan") or {}
        host_bytes = plan.get("host_bytes")
        row.update(
            elixir_step_s=elixir.get("step_s"),
            elixir_predicted_step_s=elixir.get("predicted_step_s"),
            elixir_measured_over_predicted=elixir.get("measured_over_predicted"),
            elixir_host_rss_peak_GiB=elixir.get("host_rss_peak_GiB"),
            elixir_host_rss_added_GiB=_added_rss(elixir),
            elixir_plan_host_GiB=host_bytes * first["gpus"] / 2**30 if host_bytes is not None else None,
        )
    return row


def _added_rss(r: Run) -> float | None:
    """Peak RSS less the process's before any model was built (torch, the CUDA context): what
    the system itself holds in host memory, to set against a plan's pinned arenas."""
    start = r.get("host_rss_start_GiB")
    return None if start is None or r.get("host_rss_peak_GiB") is None else r["host_rss_peak_GiB"] - start


def summarize(runs: list[Run]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[tuple, dict[str, Run]] = {}
    for r in runs:
        groups.setdefault(run_key(r)[:-1], {})[r["system"]] = r
    out: dict[str, list[dict[str, Any]]] = {"offload_regime": [], "in_gpu_regime": []}
    for key in sorted(groups, key=lambda k: (str(k[0]), next(iter(groups[k].values()))["params"], *k[2:])):
        out[regime(groups[key]) + "_regime"].append(summary_row(groups[key]))
    return out


def build_results(runs: list[Run]) -> dict[str, Any]:
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    runs = sorted(
        runs, key=lambda r: (str(r.get("card")), r["params"], r["gpus"], r["batch"], order.get(r["system"], 99))
    )
    return {"metric": METRIC, **summarize(runs), "runs": runs}


def _cell(row: dict[str, Any], system: str) -> str:
    value, status = row["tflops"].get(system), row["status"].get(system)
    text = f"{value:.1f}" if value is not None else CELL.get(status, status or "–")
    return text + (" (pageable)" if system in row.get("pageable", ()) else "")


def _on(flag: bool) -> str:
    return "1.0" if flag else "off"


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def _systems(rows: list[dict[str, Any]]) -> list[str]:
    seen = {s for row in rows for s in row["tflops"]}
    return [s for s in SYSTEM_ORDER if s in seen] + sorted(seen - set(SYSTEM_ORDER))


def _regime_table(rows: list[dict[str, Any]]) -> list[str]:
    systems = _systems(rows)
    head = [
        "card",
        "model",
        "GPUs",
        "seq",
        "bs/GPU",
        "clip",
        "fused kernels",
        *systems,
        "Elixir / best baseline",
        "Elixir step s (predicted)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ratio = row["elixir_over_best_baseline"]
        ratio_cell = f"**{ratio:.2f}×** vs {row['best_baseline']}" if ratio is not None else "–"
        step = f"{_f(row.get('elixir_step_s'))} ({_f(row.get('elixir_predicted_step_s'))})"
        cells = [
            row["card"],
            row["model"],
            row["gpus"],
            row["seq"],
            row["batch"],
            _on(row["clip"]),
            row["kernels"],
            *(_cell(row, s) for s in systems),
            ratio_cell,
            step,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _runs_table(runs: list[Run]) -> list[str]:
    head = [
        "card",
        "model",
        "GPUs",
        "seq",
        "bs",
        "clip",
        "fused kernels",
        "system",
        "status",
        "TFLOPS/GPU",
        "tokens/s",
        "MFU",
        "step s",
        "predicted s",
        "GPU alloc GiB",
        "GPU reserved GiB",
        "host RSS GiB",
        "RSS added GiB",
        "plan host GiB",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        plan = (r.get("info") or {}).get("plan") or {}
        host = plan.get("host_bytes")
        system = r["system"] + (" (pageable)" if _pageable(r) else "")
        cells = [
            r.get("card"),
            r["model"],
            r["gpus"],
            r.get("seq"),
            r["batch"],
            _on(clipped(r)),
            kernels(r),
            system,
            r.get("status"),
            _f(r.get("tflops"), ".1f"),
            _f(r.get("tokens_per_s"), ".0f"),
            _f(r.get("mfu"), ".2f"),
            _f(r.get("step_s"), ".3f"),
            _f(r.get("predicted_step_s"), ".3f"),
            _f(r.get("gpu_alloc_peak_GiB"), ".1f"),
            _f(r.get("gpu_reserved_peak_GiB"), ".1f"),
            _f(r.get("host_rss_peak_GiB"), ".1f"),
            _f(_added_rss(r), ".1f"),
            _f(host * r["gpus"] / 2**30 if host is not None else None, ".1f"),
            (r.get("error") or "").replace("|", "/")[:120],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def render_markdown(results: dict[str, Any], png: Path | None, md_dir: Path) -> str:
    runs = results["runs"]
    lines = [
        "# Training throughput: Elixir against the baselines",
        "",
        f"{METRIC}; tokens = batch per GPU × sequence length; {FLOPS_NOTE}. HF models from configs, random init "
        "(GPT-2 presets: GPT2LMHeadModel, vocab 50257, tied, seq 1024; Llama-3-8B / Qwen2.5-7B: their published "
        "configs, untied, seq 2048), SDPA, activation checkpointing on every block, bf16 compute, AdamW, random "
        "tokens. clip 1.0: every system clips gradients to a global norm of 1.0 (the HF Trainer's default "
        "`max_grad_norm`); off: no clipping (every run before the `--clip` switch). Fused kernels: the Trainer-path "
        "systems ran with `use_liger_kernel=True` (Liger, `--liger`) and/or `torch_compile=True` (compile, `--compile`: "
        "Elixir compiles each decoder layer, the stock Trainer the whole model). trainer_lossy (bf16 weights, bitsandbytes' paged "
        "8-bit AdamW) and torchao_offload_bf16 (bf16 weights and AdamW states) keep no fp32 master weights; "
        "torchao_offload's CPU update is not clipped (benchmarks/hf_systems.py). Each row compares systems "
        "measured on the same card; median of the timed steps of the slowest rank. Generated by "
        "`python -m benchmarks.report` from `results.json`.",
        "",
    ]
    if png is not None:
        lines += [f"![throughput]({os.path.relpath(png, md_dir)})", ""]
    for key, title in (
        ("offload_regime", "Offload regime (model states do not fit the GPUs)"),
        ("in_gpu_regime", "In-GPU regime (model states fit)"),
    ):
        if results[key]:
            lines += [f"## {title}", "", *_regime_table(results[key]), ""]
    lines += [
        "OOM: out of GPU memory (or Elixir's planner refused: nothing fits); n/a: system not installed "
        "(see the note below); crashed: the process died (exit -9 is usually the host OOM killer).",
        "",
        "## Runs",
        "",
        *_runs_table(runs),
        "",
        "## Environment",
        "",
    ]
    envs: dict[tuple, dict[str, str]] = {}
    for r in runs:
        if r.get("torch"):  # runs killed before reporting carry no versions
            versions = envs.setdefault((r.get("card"), r.get("driver"), r["torch"], r.get("transformers")), {})
            versions.update((k, v) for k in PACKAGES if (v := (r.get("info") or {}).get(k)))
    for (card, driver, torch_v, tf_v), versions in sorted(envs.items(), key=str):
        lines.append(
            f"- {card}, driver {driver or '?'}, torch {torch_v}, transformers {tf_v}"
            + "".join(f", {name} {versions[k]}" for k, name in PACKAGES.items() if k in versions)
        )
    missing = sorted({r["system"] for r in runs if r.get("status") == "unavailable"})
    if missing:
        notes = sorted({f"{r['system']}: {r.get('error')}" for r in runs if r.get("status") == "unavailable"})
        lines += ["", "Not run: " + "; ".join(notes) + f" ({', '.join(missing)})."]
    commands = sorted({r["command"] for r in runs if r.get("command")})
    if commands:
        lines += ["", "## Commands", "", "```", *commands, "```"]
    return "\n".join(lines) + "\n"


def render_png(results: dict[str, Any], path: Path) -> None:
    """Grouped bars per (card, model, GPUs, batch), one panel per regime; failed runs are labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (k, t) for k, t in (("offload_regime", "offload regime"), ("in_gpu_regime", "in-GPU regime")) if results[k]
    ]
    if not panels:
        return
    groups = max(len(results[k]) for k, _ in panels)
    width_in = max(12.0, 0.95 * groups)  # room for each group's three-line label (about 0.9 in at 8 pt)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 4.5 * len(panels)), squeeze=False, layout="constrained")
    for ax, (key, title) in zip(axes[:, 0], panels):
        rows = results[key]
        systems = _systems(rows)
        width = 0.8 / len(systems)
        for j, s in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(rows))]
            ys = [row["tflops"].get(s) or 0.0 for row in rows]
            # one colour per system in every panel
            ax.bar(xs, ys, width, label=s, color=_colour(s))
            for x, y, row in zip(xs, ys, rows):
                if not y and s in row["status"]:
                    ax.text(x, 0, CELL.get(row["status"][s], "?"), rotation=90, ha="center", va="bottom", fontsize=7)
                elif s == row.get("elixir_system") and row["elixir_over_best_baseline"] is not None:
                    ax.text(x, y, f"{row['elixir_over_best_baseline']:.2f}×", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(
            [
                f"{r['model']} ×{r['gpus']}\nbs {r['batch']}"
                + (" clip" if r["clip"] else "")
                + (f" {r['kernels']}" if r["kernels"] != "off" else "")
                + f"\n{_short_card(r['card'])}"
                for r in rows
            ],
            fontsize=8,
        )
        ax.set_ylabel("TFLOPS per GPU")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never on them
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _colour(system: str) -> Any:
    """One colour per system in every panel: tab10's for the first ten of ``SYSTEM_ORDER``, then their
    light variants (tab20's odd entries)."""
    if system not in SYSTEM_ORDER:
        return None
    from matplotlib import colormaps

    i = SYSTEM_ORDER.index(system)
    return colormaps["tab20"](2 * i % 20 + 2 * i // 20)


def _short_card(card: str) -> str:
    """ "NVIDIA H100 80GB HBM3" → "H100 80GB": tick labels stay inside their bar group."""
    return " ".join(card.removeprefix("NVIDIA ").split()[:2])


def default_md(out: Path) -> Path:
    """docs/benchmarks.md beside the default results; elsewhere, benchmarks.md beside ``out``."""
    return DEFAULT_MD if out == DEFAULT_OUT else out.with_name("benchmarks.md")


def write(runs: list[Run], out: Path, md: Path | None = None, render: bool = True) -> dict[str, Any]:
    """Merges ``runs`` into ``out`` (kept runs of other keys) and, if ``render``, writes the table and chart."""
    old = load_runs(out) if out.exists() else []
    results = build_results(merge_runs(old, runs))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if render:
        md = md or default_md(out)
        png = out.with_name("throughput.png")
        render_png(results, png)
        md.parent.mkdir(parents=True, exist_ok=True)
        notes = hand_written_notes(md.read_text()) if md.exists() else ""
        md.write_text(with_notes(render_markdown(results, png if png.exists() else None, md.parent), notes))
    return results


def hand_written_notes(markdown: str) -> str:
    """The hand-written section of a rendered file, its two marker lines included ("" if none)."""
    start, end = markdown.find(NOTES_BEGIN), markdown.find(NOTES_END)
    return markdown[start : end + len(NOTES_END)] if 0 <= start < end else ""


def with_notes(rendered: str, notes: str) -> str:
    """``notes`` placed before the Runs table of ``rendered`` (at its end if it has none)."""
    if not notes:
        return rendered
    head, runs, tail = rendered.partition("\n## Runs\n")
    return f"{head}\n{notes}\n{runs}{tail}" if runs else f"{rendered}\n{notes}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args(argv)
    runs: list[Run] = []
    for path in args.inputs:
        runs = merge_runs(runs, load_runs(path))
    results = write(runs, args.out, args.md)
    print(f"{len(results['runs'])} runs -> {args.out}")


if __name__ == "__main__":
    main()
