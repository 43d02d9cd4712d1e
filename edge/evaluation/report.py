"""Tables and plots for a replay evaluation (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.core.policy import LOCAL
from edge.evaluation.evaluate import Result, Simulator, summarize
from shared.errors import BackendMissing

MODEL_NOTE = (
    "Link model: each request's transfer gets the trace's whole capacity from its own start "
    "(requests do not share the link), so the oracle (the cheapest schedule for one radio, "
    "knowing the trace) is a true lower bound on every policy's total; where "
    "offloads overlap (the 'overlap' column) a real link would be shared and offloading is "
    "flattered, for every policy alike. The oracle may pre-warm the radio at the least any "
    "warming costs, so it stays a bound, one that can be far out of any policy's reach: "
    "where the promotion is long beside the tail (WiFi's 79 ms against 238 ms) it never "
    "waits for one, and 'x oracle' there says more of the link than of the policy (compare "
    "with the fixed rules). "
    "Probe energy and bytes (the agent's link probes) are charged to ours. "
    "'offloaded' counts the requests the cloud answered; an offload whose answer never "
    "came back (an outage, a deadline passed on the way) counts under misses or "
    "fallbacks, its bytes under MB sent."
)


def table(sim: Simulator, results: dict[str, Result]) -> str:
    """A markdown table: one row per policy, cost relative to the oracle."""
    rows = {name: summarize(sim, r) for name, r in results.items()}
    oracle = rows["oracle"]["mean_cost"]  # 0 where every weight is 0: no ratio to give
    lines = [
        "| policy | mean cost | x oracle | deadline misses | p50 ms | p99 ms | energy J/req "
        "| MB sent | offloaded | fallbacks | probes | overlap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows.items():
        ratio = f"{s['mean_cost'] / oracle:.3f}" if oracle > 0 else "n/a"
        lines.append(
            f"| {name} | {s['mean_cost']:.4f} | {ratio} "
            f"| {s['miss_rate'] * 100:.1f}% | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} "
            f"| {s['energy_j']:.3f} | {s['mb_sent']:.1f} | {s['offload_share'] * 100:.0f}% "
            f"| {s['fallbacks']:.0f} | {s['probes']:.0f} | {s['overlap_share'] * 100:.0f}% |"
        )
    return "\n".join(lines) + "\n\n" + MODEL_NOTE


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BackendMissing(
            "plots need matplotlib, which is not installed: pip install 'ferry[eval]' "
            "(or run without --out for the table only)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _marks(result: Result) -> dict[str, np.ndarray]:
    where = np.array([o.where for o in result.outcomes])
    fallback = np.array([o.fallback for o in result.outcomes], dtype=bool)
    return {
        "local": (where == LOCAL) & ~fallback,
        "cloud": np.array([w not in (LOCAL, "none") for w in where], dtype=bool),
        "fallback": fallback,
        "no answer": where == "none",
    }


_STYLE = {
    "local": ("tab:green", "o"),
    "cloud": ("tab:blue", "o"),
    "fallback": ("tab:red", "x"),
    "no answer": ("black", "x"),
}


def plots(sim: Simulator, results: dict[str, Result], out_dir: Path, title: str) -> list[Path]:
    plt = _pyplot()
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

    arrivals = np.array(results["ferry"].arrivals)
    end = float(arrivals.max()) + 1 if arrivals.size else 1.0
    fig, (cap, marks) = plt.subplots(
        2, 1, figsize=(11, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for trace, color, label in (
        (sim.up, "tab:gray", "uplink"),
        (sim.down, "tab:purple", "downlink"),
    ):
        t, mbps = trace.series(1.0, end)
        cap.plot(t, mbps, color=color, lw=1, label=f"{label} capacity ({trace.name})")
    cap.set_ylabel("Mbps (1 s windows)")
    cap.legend(loc="upper right", fontsize=8)
    cap.set_title(f"{title}: link capacity and each request's choice")
    for row, name in ((1.0, "ferry"), (0.0, "oracle")):
        for label, mask in _marks(results[name]).items():
            if mask.any():
                color, marker = _STYLE[label]
                marks.scatter(
                    arrivals[mask],
                    np.full(int(mask.sum()), row),
                    s=10,
                    color=color,
                    marker=marker,
                    label=label if row == 1.0 else None,
                )
    marks.set_yticks([1.0, 0.0], ["ours", "oracle"])
    marks.set_ylim(-0.6, 1.6)
    marks.set_xlabel("time (s)")
    marks.legend(loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    choice_png = out_dir / "choices.png"
    fig.savefig(choice_png, dpi=110)
    plt.close(fig)
    return [cost_png, choice_png]
