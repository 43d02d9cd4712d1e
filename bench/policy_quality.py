"""How good is the edge agent's offloading policy?  A replay grid where decisions matter.

    python bench/policy_quality.py [--quick] [--seeds 5] [--duration 600] [--rate 0.5]
        [--jobs 2] [--traces ../shared/traces] [--plot bench/out/regret.png] [--json PATH]
        [--profile bench/out/profile.json]

Setup.  The example model's compute times are measured once, here, on the
real runtimes: the int8 variant on one thread (the edge side, scaled by each
device profile's speed factor) and the FP32 model (the cloud side).  Every
cell replays Poisson arrivals (0.5/s) over its trace pair's length, capped
at ``--duration``, through the agent's own policy, estimators, breakers and
fallback plan (edge.evaluation.evaluate, the policy of examples/agent.toml
with cloud endpoints over mqtt and http) and through the baselines
always-local, always-cloud, Neurosurgeon-style static and Sedna-style
cascade, and the oracle (one radio, clairvoyant).  All of them are judged by one cost
model: examples/agent.toml's weights (latency 1/s, data 0.01/MB, energy
0.05/J or 0), plus 1 per deadline miss, with the LTE link profile's RTT,
radio promotion and tail energy.

The grid: device (raspberry-pi-4b, the example; jetson-orin-nano, a faster
one) x compute (the measured times, 3x and 10x heavier, edge and cloud
alike) x request size (an encoded image, uniform 20-100 KB, or the raw
602,112 B tensor + 256 B of envelope; a 1 KB reply either way) x deadline
(tight: max(1.5 x local p95, 300 ms); loose: max(4 x local p95, 1 s)) x
energy weight (0, the example's) x trace pair (every NAME.up/NAME.down in
../shared/traces, then synthetic: steady, Markov fading with full outages,
a commute through a tunnel) x workload seeds (arrivals, sizes, compute
draws; the synthetic traces are fixed), pooled per cell.  In
many cells offloading never pays (Orin, raw tensors): the "oracle" column
says how often the oracle offloads, so a reader can tell a tie that proves
nothing from a cell where the policy had to decide.

Targets (exit status 1 when any is missed):
  1. ours / oracle <= 1.10, averaged over all cells, and averaged over the
     cells where a decision matters (the oracle offloads, or beats every
     baseline by more than 1%);
  2. ours <= the best baseline + 1% in every cell (a tie is reported as TIE,
     not as a win; the summary also counts the losses to a fixed rule that
     misses more deadlines than ours, which keeps its deadline promise by
     racing the local run and pays that run's energy);
  3. deadline misses < 1% in every cell where the oracle has none;
  4. one cost-mode decision with two transports, context build included,
     <= 20 us median (the agent's per-request entry, EdgeCore.begin().start(),
     requests 20 ms apart, on its two expensive paths: a warm radio, where
     the cloud is chosen and exploration weighed, and a cold one, where the
     wake-up rule is; the slower is the figure; the median of 5 rounds'
     samples pooled, the lesser of two timings, before and after the grid, as
     other processes only add time).
     This machine drifts between two speed states ~1.5x apart: the figure is
     ~20 us in the fast one and ~30 us in the slow one.

The oracle is a clairvoyant schedule for one radio (a dynamic programme over
the radio's state, edge/evaluation/baselines.py): a lower bound on every
policy's total cost that a real schedule can approach, unlike the
per-request bound (radio warm and cold at once) that the replay also keeps.
"Ties" in cells where the oracle never offloads prove nothing; target 1 holds
the average over the cells where a decision matters to the same bound.

Caveats, stated by the replay itself (edge/evaluation/sim.py): requests do
not share the link (the "overlap" figure says how often ours' offloads did
overlap).  The measured confidences decide whether the cascade ever
offloads.  The deadlines derive from the measured local p95, so runs on
different measurements differ: ``--profile PATH`` measures once and reuses.

A regret plot (cumulative cost minus the oracle's, ours and each baseline,
one seed) is written for one cell where the oracle mostly offloads but not
always: the Pi, 10x compute, encoded inputs, tight deadline, the example's
energy weight, on ``--plot-trace`` (the first real trace pair by default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _policy_grid as grid  # noqa: E402

from edge.evaluation.profile import measure, read_profile, write_profile  # noqa: E402

QUICK_TRACES = 1  # --quick: the first real trace pair (if any) and the Markov one


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    p.add_argument("--repository", type=Path, default=ROOT / "examples" / "repository")
    p.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--seeds", type=int, default=None, help="workload seeds per cell (5; quick 2)")
    p.add_argument(
        "--duration", type=float, default=None, help="cap on each replay, s (600; quick 120)"
    )
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--runs", type=int, default=200, help="timed runs per compute profile")
    p.add_argument("--transports", default="mqtt,http", help="cloud endpoints the agent has")
    p.add_argument("--decisions", type=int, default=20_000, help="timed decisions")
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "regret.png")
    p.add_argument("--plot-trace", default=None, help="trace pair of the plot (first real one)")
    p.add_argument("--json", type=Path, default=None, help="write every cell's figures here")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="compute profile JSON: read it if it exists, else measure and write it there",
    )
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = 2 if args.quick else 5
    if args.duration is None:
        args.duration = 120.0 if args.quick else 600.0
    return args


def run_grid(cells: list[grid.Cell], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1:
        return [grid.run_cell(c) for c in cells]
    ctx = multiprocessing.get_context("fork")  # workers inherit grid's installed Setup
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(grid.run_cell, cells, chunksize=4))


def short(name: str) -> str:
    return {"static (Neurosurgeon)": "static", "cascade (Sedna)": "cascade"}.get(name, name)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'dev':<5}{'comp':>5} {'size':<4} {'deadline':<12}{'e/J':>5}  {'trace':<19}"
        f"{'ours/or':>8}{'best/or':>8} {'best':<13}{'miss ours':>10}{'oracle':>8}"
        f"  {'oracle offl':>11}{'ours offl':>10}  verdict"
    )
    for r in rows:
        flag = "" if r["miss_ok"] else " MISSES"
        print(
            f"{r['device']:<5}{r['compute']:>4g}x {r['size']:<4} "
            f"{r['deadline']:<5}{r['deadline_ms']:>5.0f}ms{r['energy_j']:>6g}  "
            f"{r['trace'][:19]:<19}{r['ours_vs_oracle']:>8.3f}{r['best_vs_oracle']:>8.3f} "
            f"{short(r['best']):<13}{r['ours_miss'] * 100:>9.1f}%{r['oracle_miss'] * 100:>7.1f}%"
            f"  {r['oracle_offload'] * 100:>10.0f}%{r['ours_offload'] * 100:>9.0f}%  "
            f"{r['verdict']}{flag}"
        )


def _python_figure(decision: dict[str, Any]) -> str:
    """The same decision on the core's Python sources, where the compiled core was timed."""
    python = decision.get("python")
    if not python:
        return ""
    return (
        f"; on its Python sources (FERRY_NATIVE=0) {python['median_us']:.1f} us, "
        f"{python['median_us'] / decision['median_us']:.1f}x the compiled core's time"
    )


def targets(rows: list[dict[str, Any]], decision: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(name, met, detail) per target of the issue."""
    ratios = np.array([r["ours_vs_oracle"] for r in rows])
    decisive = [r for r in rows if r["best_vs_oracle"] > 1 + grid.TIE or r["oracle_offload"] > 0]
    mean = float(ratios.mean())
    t1 = (
        f"ours/oracle averaged over {len(rows)} cells: {mean:.3f} (<= 1.10; geomean "
        f"{np.exp(np.log(ratios).mean()):.3f}, median {np.median(ratios):.3f}, worst {ratios.max():.3f}"
        + (
            f"; over the {len(decisive)} cells where the oracle offloads or beats every "
            f"baseline by >1%: {np.mean([r['ours_vs_oracle'] for r in decisive]):.3f}, "
            "held to <= 1.10 too)"
            if decisive
            else ")"
        )
    )
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("WIN", "TIE", "LOSS")}
    worst = max(rows, key=lambda r: r["ours_vs_best"])
    moot = sum(r["verdict"] == "TIE" and r["oracle_offload"] == 0 for r in rows)
    # A loss to a fixed rule that misses more deadlines than ours: ours kept the promise
    # (a local run that makes the deadline is raced, never given up) and paid for it.
    promise = sum(
        r["verdict"] == "LOSS" and r["policies"][r["best"]]["miss_rate"] > r["ours_miss"]
        for r in rows
    )
    t2 = (
        f"ours <= best baseline + 1% in every cell: {counts['WIN']} WIN, {counts['TIE']} TIE, "
        f"{counts['LOSS']} LOSS ({promise} of them to a rule that misses more deadlines); "
        f"{moot} of the ties in cells where the oracle never offloads "
        f"(worst {worst['ours_vs_best']:.3f}x {short(worst['best'])} in "
        f"{grid.Cell(**{k: worst[k] for k in grid.Cell.__dataclass_fields__}).label()})"
    )
    clean = [r for r in rows if r["oracle_miss"] == 0]
    bad = [r for r in clean if not r["miss_ok"]]
    worst_miss = max(clean, key=lambda r: r["ours_miss"]) if clean else None
    t3 = f"ours' misses < 1% in the {len(clean)} cells where the oracle has none: {len(bad)} over"
    if worst_miss is not None:
        t3 += f" (worst {worst_miss['ours_miss'] * 100:.1f}% in {worst_miss['trace']}, "
        t3 += f"{worst_miss['device']} {worst_miss['compute']:g}x {worst_miss['size']} "
        t3 += f"{worst_miss['deadline']})"
    rounds = "/".join(f"{m:.1f}" for m in decision["round_medians_us"])
    t4 = (
        f"one cost-mode decision, mqtt+http, context included: {decision['median_us']:.1f} us "
        f"median (<= 20 us; all rounds pooled, their medians {rounds}; "
        f"p99 {decision['p99_us']:.1f} us; "
        f"{decision['entry']}, {decision['iterations']} runs, chose {decision['choice']}; "
        f"paths {decision.get('paths')}; "
        f"the bare Context + Policy.decide: {decision['bare']['median_us']:.1f} us; "
        f"core {decision['core']}{_python_figure(decision)})"
    )
    # Over the cells where the decision matters too: averaged with the ties where it
    # cannot, a policy that lost every decisive cell by 30% had still read 1.03.
    decisive_mean = np.mean([r["ours_vs_oracle"] for r in decisive]) if decisive else 1.0
    return [
        ("target 1", mean <= 1.10 and decisive_mean <= 1.10, t1),
        ("target 2", counts["LOSS"] == 0, t2),
        ("target 3", not bad, t3),
        ("target 4", decision["median_us"] <= 20.0, t4),
    ]


def plot(setup: grid.Setup, trace: str, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = grid.Cell(
        "pi4b",
        10.0,
        "enc",
        "tight",
        grid.deadlines_ms(setup.local_s, "pi4b", 10.0)["tight"],
        setup.policy.weights.energy_j,
        trace,
    )
    s = grid.regret_series(setup, cell)
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = iter(("--", ":", "-.", (0, (5, 1, 1, 1))))  # baselines that coincide stay visible
    for name, series in s["regret"].items():
        ours = name == "ferry"
        style = "-" if ours else next(styles)
        label, lw = ("ours", 2.4) if ours else (name, 1.4)
        ax.plot(s["t"], series, linestyle=style, label=label, lw=lw)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("cumulative cost - oracle's")
    ax.set_title(f"regret, seed 0: {cell.label()}", fontsize=9)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return cell.label()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    if args.profile is not None and args.profile.exists():
        # The compute profile is the grid's input data, not a timing: reuse one to
        # compare runs on the same deadlines (they derive from its local p95).
        doc = read_profile(args.profile)
        local_s, cloud_s = list(doc.local_s), list(doc.cloud_s)
        confidences = list(doc.confidences)
        stoppable = doc.local_cancellable
        print(f"compute profile from {args.profile}")
    else:
        print("measuring the compute profile on the real runtimes ...")
        local = measure(args.repository, "orientation-int8", args.runs, threads=1)
        local_s, confidences, stoppable = local
        cloud_s = measure(args.repository, "orientation", args.runs).latencies
        if args.profile is not None:
            args.profile.parent.mkdir(parents=True, exist_ok=True)
            meta = {"runs": args.runs, "local_cancellable": stoppable}
            write_profile(args.profile, local_s, cloud_s, confidences, meta)
    low = float(np.mean(np.array(confidences) < 0.8)) if confidences else 0.0
    print(
        f"  local int8, 1 thread: p50 {np.median(local_s) * 1e3:.1f} ms on this host "
        f"(x8 on the Pi, x0.1 on the Orin); cloud FP32: p50 {np.median(cloud_s) * 1e3:.1f} "
        f"ms; {low * 100:.0f}% of local answers under 0.8 confidence (the cascade's threshold)"
    )
    policy = grid.example_policy(ROOT)
    pairs = grid.trace_pairs(args.traces, args.duration)
    setup = grid.Setup(
        tuple(local_s),
        tuple(cloud_s),
        tuple(confidences),
        pairs,
        policy,
        args.duration,
        args.rate,
        args.seeds,
        tuple(args.transports.split(",")),
        stoppable,
    )
    grid.install(setup)
    real = [n for n in pairs if not n.startswith("synth-")]
    if args.quick:
        traces = (*real[:QUICK_TRACES], "synth-markov-off")
        cells = grid.build_grid(
            setup, ("pi4b",), (1.0, 10.0), tuple(grid.SIZES), (policy.weights.energy_j,), traces
        )
    else:
        energies = (0.0, policy.weights.energy_j)
        cells = grid.build_grid(
            setup, tuple(grid.DEVICES), grid.COMPUTE, tuple(grid.SIZES), energies, tuple(pairs)
        )
    for dev in sorted({c.device for c in cells}):
        for k in sorted({c.compute for c in cells}):
            dl = grid.deadlines_ms(setup.local_s, dev, k)
            print(
                f"  {dev} {k:g}x: local p95 "
                f"{grid.local_p95_s(setup.local_s, grid.load_device(grid.DEVICES[dev]), k) * 1e3:.0f}"
                f" ms; deadlines tight {dl['tight']:.0f} ms, loose {dl['loose']:.0f} ms"
            )
    print(
        f"  {len(cells)} cells x {args.seeds} seeds; Poisson {args.rate}/s over each trace pair "
        f"(capped at {args.duration:g} s); transports {setup.transports}; weights "
        f"{policy.weights}; explore_after_s {policy.explore_after_s:g}; traces: {', '.join(pairs)}"
    )
    timed = [grid.time_decision(setup, args.decisions)]  # before and after the grid: a
    rows = run_grid(cells, args.jobs)  # busy neighbour rarely slows both
    grid_s = time.perf_counter() - started
    print_table(rows)

    timed.append(grid.time_decision(setup, args.decisions))
    decision = min(timed, key=lambda d: d["median_us"])
    decision["python"] = grid.time_decision_python(setup, args.decisions)
    both = " and ".join(f"{d['median_us']:.1f}" for d in timed)
    options = "; ".join(decision["options"])
    print(f"\ndecision timed before and after the grid: {both} us; options {options}")
    over = max(rows, key=lambda r: r["ours_overlap"])
    print(
        f"ours' offloads overlapping an earlier transfer (the replay lets them share nothing): "
        f"at most {over['ours_overlap'] * 100:.0f}% in a cell "
        f"({over['device']} {over['compute']:g}x {over['size']} {over['deadline']} {over['trace']})"
    )
    never = sum(r["oracle_offload"] == 0 for r in rows)
    print(f"cells where the oracle never offloads: {never} of {len(rows)}")
    plot_trace = args.plot_trace or (real[0] if real else "synth-commute")
    try:
        label = plot(setup, plot_trace, args.plot)
        print(f"regret plot: {args.plot} ({label})")
    except Exception as exc:  # the plot is a by-product; never hide the verdicts behind it
        print(f"regret plot FAILED: {type(exc).__name__}: {exc}")

    results = targets(rows, decision)
    print()
    for name, met, detail in results:
        print(f"{name} {'PASS' if met else 'MISS'}: {detail}")
    elapsed = time.perf_counter() - started
    print(f"({len(cells)} cells in {grid_s:.0f} s, {elapsed:.0f} s in all, {args.jobs} jobs)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "setup": {
                "local_s": local_s,
                "cloud_s": cloud_s,
                "rate": args.rate,
                "seeds": args.seeds,
                "duration_cap_s": args.duration,
                "transports": setup.transports,
                "quick": args.quick,
            },
            "cells": rows,
            "decision": timed,
            "targets": [{"target": n, "met": m, "detail": d} for n, m, d in results],
        }
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"figures: {args.json}")
    return 0 if all(met for _, met, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
