"""``elixir-plan --plot``: one rank's GPU memory budget and where every chunk lives, as a PNG."""

from __future__ import annotations

from elixir_runtime.plan import DEVICE_MEMORY, ElixirPlan

__all__ = ["memory_bars", "plot_plan"]

GIB = 2**30

_BARS = {
    "rcache": ("rCache", "tab:blue"),
    "private": ("private blocks", "tab:purple"),
    "device_shards": ("GPU-resident shards", "tab:green"),
    "device_grads": ("their gradients beyond the activations' slack", "tab:olive"),
    "lane_staging": ("device-lane staging", "tab:cyan"),
}
"""Label and colour of each of the plan's ``DEVICE_MEMORY`` parts in the plot."""


def memory_bars(plan: ElixirPlan) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) of the plot's GPU bar, left to right: the searched plan's
    ``DEVICE_MEMORY`` (what ``U_allowed`` bounds; gradient shards beyond the activation memory freed
    under them), then the activation budget and buffers. Empty parts are left out."""
    parts = [(_BARS[k][0], getattr(plan.memory, k), _BARS[k][1]) for k in DEVICE_MEMORY]
    parts += [
        (f"activations x {plan.budget.f_frag}", int(plan.budget.f_frag * (plan.memory.activations or 0)), "tab:orange"),
        ("buffers", plan.memory.buffers or 0, "tab:gray"),
    ]
    return [part for part in parts if part[1] > 0]


def plot_plan(plan: ElixirPlan, path: str, title: str = "") -> None:
    """Two panels: the GPU memory budget of one rank (a searched plan's), and where every chunk lives."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, chunk_ax) = plt.subplots(2, 1, figsize=(11, 5.5), gridspec_kw={"height_ratios": [1, 1]})
    _memory_panel(mem_ax, plan, title)
    _chunk_panel(chunk_ax, plan)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _memory_panel(ax, plan: ElixirPlan, title: str) -> None:
    budget = plan.budget
    left = 0.0
    for label, size, color in memory_bars(plan):
        ax.barh(0, size / GIB, left=left, color=color, label=f"{label} {size / GIB:.1f}")
        left += size / GIB
    ax.axvline(budget.capacity / GIB, color="black", label=f"capacity {budget.capacity / GIB:.1f}")
    ax.axvline(budget.allowed / GIB, color="red", linestyle="--",
               label=f"U_allowed {budget.allowed / GIB:.1f}: model states end before it")
    ax.set_yticks([])
    ax.set_xlabel("GiB per GPU")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8)
    ax.set_title(title, fontsize=9)


def _chunk_panel(ax, plan: ElixirPlan) -> None:
    off = set(plan.offload)
    colors = ["tab:red" if i in off else "tab:green" for i in range(plan.n_chunks)]
    ax.bar(range(plan.n_chunks), [1] * plan.n_chunks, width=1.0, color=colors, edgecolor="white", linewidth=0.3)
    ax.set_yticks([])
    ax.set_xlim(-0.5, plan.n_chunks - 0.5)
    ax.set_xlabel(
        f"chunk (forward order): green = shard + optimizer state on the GPU, red = offloaded to pinned host memory; "
        f"rCache {plan.n_blocks} blocks of {plan.chunk_size / 2**20:.0f} Mi elements",
        fontsize=8,
    )
    if plan.predicted is not None:
        ax.set_title(f"predicted step {plan.predicted.total:.3f} s", fontsize=9)
