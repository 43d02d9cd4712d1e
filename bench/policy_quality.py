"""Policy quality on real and synthetic link traces, relative to the oracle.

    python bench/policy_quality.py [--rate 0.5] [--seeds 3] [--traces ../shared/traces]

For every uplink/downlink pair in ../shared/traces and three synthetic
traces (steady, Markov fading with full outages, a commute with a tunnel),
for the example model on the Raspberry Pi 4B and Jetson Orin Nano profiles
with the LTE link profile, replays a workload through every policy (ours,
always-local, always-cloud, static Neurosurgeon-style, Sedna-style cascade,
oracle) and prints each policy's cost relative to the oracle.

Honest numbers: the compute times are measured here on the real runtimes
(the example's int8 variant on one thread, scaled by the device profile's
speed factor; the FP32 model for the cloud), and every request sends the
model's real input, a 1x3x224x224 FP32 tensor (602,112 B + envelope):
nothing in Ferry decodes JPEG, so no smaller payload is assumed.  Arrivals
(Poisson) are spread over each trace's whole length at a modest rate, so
the replay model's one simplification (requests do not share the link) is
rarely exercised; the 'overlap' column says how often offloads did overlap.

Where offloading never pays for a profile the output says so; a labelled
extra scenario (a 10x heavier model on the same Pi, same input) shows a
case where it does.

Targets, per scenario: ours within 1.10x of the oracle on average over the
traces; better than the best baseline on every trace (a tie is reported as
a tie, not as a win; a loss misses the target); deadline-miss rate under 1%
on every trace where the oracle's is 0.  The exit status is 1 when a
target of the issue's two scenarios (Pi 4B, Orin Nano) is missed; the extra
scenario's verdicts are printed the same way but do not set it.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devices.profiles import load_device, load_link  # noqa: E402
from edge.core.policy import ModelPolicy, PolicyConfig, Weights  # noqa: E402
from edge.evaluation.evaluate import BASELINES, ComputeProfile, Workload, evaluate  # noqa: E402
from edge.evaluation.profile import measure  # noqa: E402
from edge.netem.traces import Trace, commute, load_trace, markov_fading, steady  # noqa: E402

NAMES = ("ferry", *BASELINES)
TIE = 1e-6  # relative difference under which two mean costs are a tie


@dataclass
class Pooled:
    """Per-policy totals over a trace's workload seeds."""

    cost: dict[str, float]
    missed: dict[str, int]
    offloaded: dict[str, int]
    overlap: float
    probes: int
    probe_cost: float  # the part of ours' cost that its link probes took (diagnostic)
    requests: int


def trace_pairs(folder: Path) -> dict[str, tuple[Trace, Trace]]:
    pairs: dict[str, tuple[Trace, Trace]] = {}
    if folder.is_dir():
        for up in sorted(folder.glob("*.up")):
            down = up.with_suffix(".down")
            if down.exists():
                pairs[up.stem] = (load_trace(up), load_trace(down))
    else:
        print(f"  (no real traces: {folder} not found; synthetic ones only)")
    pairs["synthetic-steady"] = (steady(8.0, 300, "steady-8"), steady(30.0, 300, "steady-30"))
    pairs["synthetic-markov"] = (
        markov_fading(300, seed=1, bad_mbps=0.0, name="markov-1-off"),
        markov_fading(300, seed=2, good_mbps=30, name="markov-2"),
    )
    pairs["synthetic-commute"] = (commute(300, seed=3), commute(300, seed=4))
    return pairs


def replay(
    up: Trace,
    down: Trace,
    device_name: str,
    profile: ComputeProfile,
    config: PolicyConfig,
    base: Workload,
    seeds: int,
) -> Pooled:
    duration = up.period_ms / 1000.0
    count = max(int(duration * base.rate_per_s), 1)
    pooled = Pooled({n: 0.0 for n in (*NAMES, "oracle")}, {}, {}, 0.0, 0, 0.0, 0)
    pooled.missed = {n: 0 for n in pooled.cost}
    pooled.offloaded = {n: 0 for n in pooled.cost}
    overlaps = []
    for seed in range(seeds):
        ev = evaluate(
            up=up,
            down=down,
            link=load_link("lte"),
            device=load_device(device_name),
            profile=profile,
            config=config,
            model="orientation",
            workload=replace(base, count=count, seed=seed),
        )
        for name, result in ev.results.items():
            pooled.cost[name] += sum(ev.sim.cost(o) for o in result.outcomes)
            pooled.missed[name] += sum(o.missed for o in result.outcomes)
            pooled.offloaded[name] += sum(o.where not in ("local", "none") for o in result.outcomes)
        ours = [o.radio for o in ev.results["ferry"].outcomes if o.radio is not None]
        busy, n = -math.inf, 0
        for start, end in ours:
            n += start < busy
            busy = max(busy, end)
        overlaps.append(n / len(ours) if ours else 0.0)
        pooled.probes += sum(o.probes for o in ev.results["ferry"].outcomes)
        pooled.probe_cost += sum(
            config.weights.energy_j * o.probe_energy_j for o in ev.results["ferry"].outcomes
        )
        pooled.requests += count
    pooled.overlap = float(np.mean(overlaps))
    return pooled


def run_scenario(
    label: str,
    device_name: str,
    profile: ComputeProfile,
    config: PolicyConfig,
    workload: Workload,
    pairs: dict[str, tuple[Trace, Trace]],
    seeds: int,
) -> tuple[bool, bool]:
    """Print one scenario's table and verdicts; returns (targets met, offloading paid)."""
    print(f"\n## {label}")
    print("  (the last column is a diagnostic only; every verdict uses ours' full cost)")
    print(
        f"  {'trace':<20}" + "".join(f"{n[:13]:>15}" for n in NAMES) + "   vs best   "
        "ours miss  oracle miss  ours off  oracle off  overlap  probes  (ours w/o probe J)"
    )
    ratios, losses, ties, wins, miss_fail = [], [], [], [], []
    oracle_offloads = 0
    for trace_name, (up, down) in pairs.items():
        p = replay(up, down, device_name, profile, config, workload, seeds)
        n = p.requests
        oracle = p.cost["oracle"] / n
        rel = {k: p.cost[k] / n / oracle for k in NAMES}
        ratios.append(rel["ferry"])
        best = min(BASELINES, key=lambda k: rel[k])
        if abs(rel["ferry"] - rel[best]) <= TIE * rel[best]:
            verdict = f"tie ({best[:6]})"
            ties.append(trace_name)
        elif rel["ferry"] < rel[best]:
            verdict = "better"
            wins.append(trace_name)
        else:
            verdict = f"LOSES ({best[:6]})"
            losses.append(trace_name)
        ours_miss, oracle_miss = p.missed["ferry"] / n, p.missed["oracle"] / n
        if oracle_miss == 0 and ours_miss >= 0.01:
            miss_fail.append(trace_name)
            verdict += " MISS>1%"
        oracle_offloads += p.offloaded["oracle"]
        print(
            f"  {trace_name:<20}"
            + "".join(f"{rel[k]:>15.3f}" for k in NAMES)
            + f"   {verdict:<12}{ours_miss * 100:>7.1f}%{oracle_miss * 100:>11.1f}%"
            + f"{p.offloaded['ferry'] / n * 100:>9.0f}%{p.offloaded['oracle'] / n * 100:>10.0f}%"
            + f"{p.overlap * 100:>8.0f}%{p.probes:>8d}"
            + f"{(p.cost['ferry'] - p.probe_cost) / n / oracle:>12.3f}"
        )
    mean_ratio = float(np.mean(ratios))
    paid = oracle_offloads > 0
    if not paid:
        print(
            "  offloading never pays here: the oracle runs every request locally on every trace "
            "(602 KB over LTE costs more than the local run)"
        )
    t1 = mean_ratio <= 1.10
    t2 = not losses
    t3 = not miss_fail
    print(
        f"  target 1, ours within 1.10x of the oracle on average: {mean_ratio:.3f} -> "
        + ("met" if t1 else "MISSED")
    )
    print(
        f"  target 2, better than the best baseline on every trace: {len(wins)} better, "
        f"{len(ties)} tied{' (' + ', '.join(ties) + ')' if ties else ''}, {len(losses)} lost"
        f"{' (' + ', '.join(losses) + ')' if losses else ''} -> "
        + ("met" if t2 and not ties else "met only as ties" if t2 else "MISSED")
    )
    print(
        "  target 3, miss rate < 1% where the oracle's is 0: "
        + ("met" if t3 else f"MISSED on {', '.join(miss_fail)}")
    )
    return t1 and t2 and t3, paid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "examples" / "repository")
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds pooled per trace")
    parser.add_argument("--deadline-ms", type=float, default=1000.0)
    parser.add_argument("--heavy-deadline-ms", type=float, default=3000.0)
    parser.add_argument("--heavier", type=float, default=10.0, help="the heavier model's factor")
    parser.add_argument("--energy-weight", type=float, default=0.005, help="cost per joule")
    parser.add_argument("--explore-after-s", type=float, default=None)
    args = parser.parse_args(argv)

    print("measuring compute profiles on the real runtimes ...")
    local_s, confidences = measure(args.repository, "orientation-int8", 60, threads=1)
    cloud_s, _ = measure(args.repository, "orientation", 60)
    print(
        f"  local int8 (1 thread) p50 {np.median(local_s) * 1000:.1f} ms; "
        f"cloud fp32 p50 {np.median(cloud_s) * 1000:.1f} ms; "
        f"{np.mean(np.array(confidences) < 0.8) * 100:.0f}% of local answers under 0.8 confidence"
    )
    extra = {} if args.explore_after_s is None else {"explore_after_s": args.explore_after_s}
    config = PolicyConfig(
        weights=Weights(latency_s=1.0, energy_j=args.energy_weight, data_mb=0.001),
        models={
            "orientation": ModelPolicy(
                local_model="orientation-int8", cloud_model="orientation", transports=("mqtt",)
            )
        },
        **extra,
    )
    workload = Workload(rate_per_s=args.rate, output_bytes=1_024)
    print(
        f"  workload: Poisson at {args.rate}/s over each trace's length, {args.seeds} seeds, "
        f"{workload.input_bytes} B up / {workload.output_bytes} B down per request; weights: "
        f"1/s latency, {args.energy_weight}/J, 0.001/MB; explore_after_s "
        f"{config.explore_after_s:g}; miss penalty 1; LTE link profile (RTT, radio power)"
    )
    pairs = trace_pairs(args.traces)
    ok = True
    for device_name in ("raspberry-pi-4b", "jetson-orin-nano"):
        device = load_device(device_name)
        profile = ComputeProfile(
            tuple(local_s), tuple(cloud_s), tuple(confidences), device.speed_factor
        )
        label = (
            f"example model on {device_name} (local x{device.speed_factor:g}: "
            f"~{np.median(local_s) * device.speed_factor * 1000:.0f} ms), deadline "
            f"{args.deadline_ms:.0f} ms: mean cost / oracle"
        )
        wl = replace(workload, deadline_ms=args.deadline_ms)
        met, _ = run_scenario(label, device_name, profile, config, wl, pairs, args.seeds)
        ok &= met
    k = args.heavier
    device = load_device("raspberry-pi-4b")
    profile = ComputeProfile(
        tuple(x * k for x in local_s),
        tuple(x * k for x in cloud_s),
        tuple(confidences),
        device.speed_factor,
    )
    label = (
        f"EXTRA, HYPOTHETICAL: a {k:g}x heavier model (the example's measured times x{k:g} on "
        f"both sides, same 602 KB input) on raspberry-pi-4b (~"
        f"{np.median(local_s) * k * device.speed_factor * 1000:.0f} ms locally), deadline "
        f"{args.heavy_deadline_ms:.0f} ms"
    )
    wl = replace(workload, deadline_ms=args.heavy_deadline_ms)
    extra_met, paid = run_scenario(
        label, "raspberry-pi-4b", profile, config, wl, pairs, args.seeds
    )
    if not extra_met:
        print(
            "  (this extra scenario is beyond the issue's targets: its verdicts are reported, "
            "not counted in the exit status)"
        )
    if not paid:
        print("  (offloading does not pay in the extra scenario either: raise --heavier)")
    print("\nall targets met" if ok else "\nsome targets MISSED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
