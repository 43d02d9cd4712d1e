"""Tables and plots for a replay evaluation (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.evaluate import CLOUD, Result, Simulator, summarize
from edge.policy import LOCAL


def table(sim: Simulator, results: dict[str, Result]) -> str:
    """A markdown table: one row per policy, cost relative to the oracle."""
    rows = {name: summarize(sim, r) for name, r in results.items()}
    oracle = rows["oracle"]["mean_cost"] or 1e-12
    lines = [
        "| policy | mean cost | x oracle | deadline misses | p50 ms | p99 ms | energy J/req | MB sent | offloaded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows.items():
        lines.append(
            f"| {name} | {s['mean_cost']:.4f} | {s['mean_cost'] / oracle:.2f} | {s['miss_rate'] * 100:.1f}% "
            f"| {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['energy_j']:.3f} | {s['mb_sent']:.1f} "
            f"| {s['offload_share'] * 100:.0f}% |"
        )
    return "\n".join(lines)


def plots(sim: Simulator, results: dict[str, Result], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(results)
    stats = [summarize(sim, results[n]) for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [s["mean_cost"] for s in stats], color="tab:blue")
    a.set_ylabel("mean cost per request")
    a.set_title("cost")
    b.bar(names, [s["miss_rate"] * 100 for s in stats], color="tab:red")
    b.set_ylabel("deadline misses (%)")
    b.set_title("deadline misses")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    cost_png = out_dir / "cost.png"
    fig.savefig(cost_png, dpi=110)
    plt.close(fig)

    ours = results["ferry"]
    end = max(ours.arrivals) + 1 if ours.arrivals else 1
    t, mbps = sim.up.series(1.0, end)
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot(t, mbps, color="tab:gray", lw=1, label="uplink capacity (Mbps)")
    arr = np.array(ours.arrivals)
    where = np.array([o.where for o in ours.outcomes])
    top = max(float(np.max(mbps)) if len(mbps) else 1.0, 1.0)
    for label, mask, color, y in (
        ("ran locally", where == LOCAL, "tab:green", 0.95),
        ("offloaded", where == CLOUD, "tab:blue", 0.9),
    ):
        ax.scatter(arr[mask], np.full(mask.sum(), top * y), s=6, color=color, label=label)
    fb = np.array([o.fallback for o in ours.outcomes])
    if fb.any():
        ax.scatter(
            arr[fb],
            np.full(fb.sum(), top * 0.85),
            s=10,
            marker="x",
            color="tab:red",
            label="fallback",
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("Mbps")
    ax.set_title(f"{title}: link capacity and each request's choice (ferry policy)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    choice_png = out_dir / "choices.png"
    fig.savefig(choice_png, dpi=110)
    plt.close(fig)
    return [cost_png, choice_png]
