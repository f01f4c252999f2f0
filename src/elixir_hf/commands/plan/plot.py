"""``elixir-plan --plot``: one GPU's memory, the host's pinned memory, and which layers each chunk
holds and where it lives, as a PNG."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elixir_runtime.plan_view import MEMORY_PARTS, chunk_layers
from elixir_runtime.planner import DEVICE_MEMORY, ElixirPlan

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["memory_bars", "host_bars", "plot_plan"]

GIB = 2**30
ON_GPU, OFFLOADED = "tab:green", "tab:red"

_COLOURS = {
    "rcache": "tab:blue",
    "private": "tab:purple",
    "device_shards": ON_GPU,
    "device_grads": "tab:olive",
    "lane_staging": "tab:cyan",
}
"""The colour of each of the plan's ``DEVICE_MEMORY`` parts in the plot (their labels: ``MEMORY_PARTS``)."""


def memory_bars(plan: ElixirPlan) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) of the plot's GPU bar, left to right: the searched plan's
    ``DEVICE_MEMORY`` (what the budget for model states bounds; gradient shards beyond the
    activation memory freed under them), then the activations as budgeted (x the fragmentation
    factor) and buffers. Empty parts are left out."""
    assert plan.budget is not None, "a searched plan"
    parts = [(MEMORY_PARTS[k], getattr(plan.memory, k), _COLOURS[k]) for k in DEVICE_MEMORY]
    parts += [
        (
            f"activations (peak x {plan.budget.f_frag} for fragmentation)",
            int(plan.budget.f_frag * (plan.memory.activations or 0)),
            "tab:orange",
        ),
        ("buffers", plan.memory.buffers or 0, "tab:gray"),
    ]
    return [part for part in parts if part[1] > 0]


def host_bars(plan: ElixirPlan) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) of the plot's host bar: the pinned shards of offloaded chunks of every
    GPU on the host (empty when nothing is offloaded)."""
    assert plan.budget is not None, "a searched plan"
    ranks = plan.budget.ranks_per_host
    pinned = plan.host_bytes * ranks
    label = "offloaded chunks, pinned" + (f" ({ranks} GPUs x {plan.host_bytes / GIB:.1f})" if ranks > 1 else "")
    return [(label, pinned, OFFLOADED)] if pinned else []


def plot_plan(plan: ElixirPlan, path: str, title: str = "") -> None:
    """Three panels: the GPU memory of one rank (a searched plan's), the host's pinned memory, and
    every chunk in forward order with the layers it holds, on the GPU or offloaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gpu_ax, host_ax, chunk_ax) = plt.subplots(3, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [1, 1, 1.3]})
    _gpu_panel(gpu_ax, plan, title)
    _host_panel(host_ax, plan)
    _chunk_panel(chunk_ax, plan)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legends sit right of the axes
    plt.close(fig)


def _stacked(ax: Axes, bars: list[tuple[str, int, str]]) -> None:
    left = 0.0
    for label, size, color in bars:
        ax.barh(0, size / GIB, left=left, color=color, label=f"{label}: {size / GIB:.1f}")
        left += size / GIB
    ax.set_yticks([])


def _gpu_panel(ax: Axes, plan: ElixirPlan, title: str) -> None:
    budget = plan.budget
    assert budget is not None, "a searched plan"
    _stacked(ax, memory_bars(plan))
    ax.axvline(budget.capacity / GIB, color="black", label=f"GPU memory: {budget.capacity / GIB:.1f}")
    ax.axvline(
        budget.allowed / GIB,
        color="red",
        linestyle="--",
        label=f"room for model states and cache: {budget.allowed / GIB:.1f}",
    )
    ax.set_xlabel("GPU memory per GPU, GiB")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.set_title(title, fontsize=9)


def _host_panel(ax: Axes, plan: ElixirPlan) -> None:
    budget = plan.budget
    assert budget is not None, "a searched plan"
    _stacked(ax, host_bars(plan))
    ax.axvline(budget.host_capacity / GIB, color="black", label=f"host memory: {budget.host_capacity / GIB:.1f}")
    usable = budget.host_allowed * budget.ranks_per_host
    ax.axvline(usable / GIB, color="red", linestyle="--", label=f"usable for pinned chunks: {usable / GIB:.1f}")
    ax.set_xlim(0, budget.host_capacity / GIB * 1.05)
    ax.set_xlabel("host memory (this host), GiB" + ("" if plan.offload else ": nothing offloaded"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def _chunk_panel(ax: Axes, plan: ElixirPlan, max_labels: int = 40) -> None:
    off = set(plan.offload)
    n = plan.n_chunks
    ax.bar(
        range(n),
        [1] * n,
        width=1.0,
        color=[OFFLOADED if i in off else ON_GPU for i in range(n)],
        edgecolor="white",
        linewidth=0.3,
    )
    ax.set_yticks([])
    ax.set_xlim(-0.5, n - 0.5)
    layers = chunk_layers(plan)
    step = max(1, -(-n // max_labels))  # at most max_labels ticks, evenly spaced
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [layers[i] or str(i) for i in ticks], rotation=90, fontsize=6)
    ax.set_xlabel(
        "chunks in forward order, labelled with the layers they hold\ngreen: on the GPU; red: offloaded to pinned host "
        f"memory, updated by the CPU; gathered-parameter cache: {plan.n_blocks} blocks of "
        f"{plan.chunk_size / 1e6:.1f} M parameters",
        fontsize=8,
    )
    if plan.predicted is not None:
        ax.set_title(f"{len(off)} of {n} chunks offloaded; predicted step {plan.predicted.total:.3f} s", fontsize=9)
