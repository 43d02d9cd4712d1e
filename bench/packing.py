"""Placement benchmark: nodes used against the lower bound, and the same packing simulated.
``python bench/packing.py [--quick] [--profiles FILE] [--no-live]``.

(a) Fleets of 50, 200 and 1,000 models (and one memory-bound fleet of 1,000,
ModelMesh style: big models, little traffic) with heavy-tailed Poisson rates
(lognormal, seeded) and latency profiles derived from measurements.  Nodes
used by ``place`` planned for what (b) asks (99% of each model's requests in
time under Poisson arrivals: ``Headroom()``) against ``lower_bounds`` for
the same traffic (a bound on any schedule at all: ``cloud/placement/bounds.py``
has the proof) and DESIGN.md's plain compute bound, next to three baselines
under the same rules and headroom: first-fit by memory (each model split into
the same copies, so compute fits too), one copy per node, and ModelMesh's
rule (one copy, a second for a model in regular use, more above 2,000
req/min per copy; copies to servers with room, then fewest models, then most
free memory; nodes added until every node's copies fit).  "floor" is the
node time our copies need at the least (each copy's work, and one overhead
per cycle it has requests in, cycles as long as its objective; summed,
rounded up): what separates ours from it is the margins a node's turns are
planned with and packing.  Target: ours <= 1.10x the bound.

(b) A discrete-event simulation (``bench/_packing_sim.py``) of each compute-bound
fleet's packing as Ferry's nodes serve it: one dynamic batcher per model,
the models taking turns, one batch at a time with the node to itself.  Target rows
(*): the packing of (a) under Poisson arrivals, and the packing planned for
the measured burstiness (``Headroom(cv=2)``, the controller's ``--burst-cv``)
under Gamma (CV 2) arrivals: >= 99% of every model's requests within its SLO.
The other rows show what planning on means, or for Poisson when the traffic
is bursty, would do (no target).  Bursty rows are graded against the bound
for bursty traffic (Lorden's inequality in place of Poisson's memory).  The
memory-bound fleet is placement only: its models see a request a minute,
and compute is not what binds there.

(c) the three-node fleet for real (``bench/_packing_live.py``; ``--no-live`` skips it).

Profiles: with ``--profiles FILE`` (written by ``ferry-cloud tune``) each fleet
model takes a measured model's profiles in turn; without it, figures measured
on this machine (ONNX Runtime, 2 threads) for the real text-orientation CNN:
fp32 a=1.9 ms, beta=0.75 ms/item, 28 MB; its static-QDQ int8 variant a=1.4 ms,
beta=0.55 ms, 9 MB; OpenVINO a=1.2 ms, beta=0.6 ms, 40 MB; max batch 32.  Each
fleet model is that network scaled by a size factor (lognormal, sigma 0.5:
bigger and smaller models of the family: a, beta and memory scale together)
with +-10% jitter on each figure; 30% of the models ship the int8 variant as
their ONNX Runtime profile.  SLOs are log-uniform in 50-500 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._packing_sim import simulate  # noqa: E402
from cloud.placement.bins import SMALL, Bin  # noqa: E402
from cloud.placement.bounds import bound_sums  # noqa: E402
from cloud.placement.demand import kinds, split  # noqa: E402
from cloud.placement.packing import Headroom, check, lower_bounds, place  # noqa: E402
from cloud.placement.sizing import fits, size  # noqa: E402
from cloud.placement.types import LatencyProfile, ModelDemand, NodeSpec, Placement  # noqa: E402

MB, GIB = 1_000_000, 1 << 30
TARGET = 1.10
MEANS = Headroom(quantile=0.5, cv=0.0)
MEASURED = {
    "orientation": (
        LatencyProfile("onnxruntime", 1.9e-3, 0.75e-3, 32, 28 * MB, threads=2),
        LatencyProfile("openvino", 1.2e-3, 0.6e-3, 32, 40 * MB, threads=2),
    ),
    "orientation-int8": (
        LatencyProfile("onnxruntime", 1.4e-3, 0.55e-3, 32, 9 * MB, threads=2),
        LatencyProfile("openvino", 1.2e-3, 0.6e-3, 32, 40 * MB, threads=2),
    ),
}


@dataclass(frozen=True)
class Fleet:
    name: str
    models: int
    rate_median: float  # requests/s
    rate_sigma: float  # of log rate
    memory_scale: float  # memory multiplier (median) on top of the size factor
    seed: int


FLEETS = (
    Fleet("50 models", 50, 20.0, 1.5, 1.0, 50),
    Fleet("200 models", 200, 20.0, 1.5, 1.0, 200),
    Fleet("1,000 models", 1000, 20.0, 1.5, 1.0, 1000),
    Fleet("1,000 memory-bound", 1000, 0.5, 1.0, 25.0, 1001),
)


def load_profiles(path: Path | None) -> dict[str, tuple[LatencyProfile, ...]]:
    """Measured profiles per model: from ``tune``'s JSON, else this machine's figures.

    Reads ``models.<name>.profiles`` (one :class:`LatencyProfile` per backend) and
    puts ``chosen``'s backend first (the baselines run the first profile); a
    model with no profiles but a full profile as ``chosen`` uses that."""
    if path is None:
        return MEASURED
    data = json.loads(path.read_text())
    found: dict[str, tuple[LatencyProfile, ...]] = {}
    for name, entry in sorted(data["models"].items()):
        chosen = entry.get("chosen") or {}
        listed = [LatencyProfile.from_dict(p) for p in entry.get("profiles") or []]
        if not listed and "a_s" in chosen:
            listed = [LatencyProfile.from_dict(chosen)]
        listed.sort(key=lambda p: p.backend != chosen.get("backend"))
        if listed:
            found[name] = tuple(listed)
    if not found:
        raise SystemExit(f"{path}: no model has a latency profile")
    return found


def make_fleet(fleet: Fleet, measured: dict[str, tuple[LatencyProfile, ...]]) -> list[ModelDemand]:
    rng = np.random.default_rng(fleet.seed)
    names = sorted(measured)
    models = []
    for i in range(fleet.models):
        if measured is MEASURED:
            base = measured["orientation-int8" if rng.random() < 0.3 else "orientation"]
        else:
            base = measured[names[i % len(names)]]
        factor = float(np.clip(rng.lognormal(0.0, 0.5), 0.25, 4.0))
        memory = factor * float(np.clip(rng.lognormal(math.log(fleet.memory_scale), 0.7), 1, 100))
        profiles = tuple(
            replace(
                p,
                a_s=p.a_s * factor * rng.uniform(0.9, 1.1),
                beta_s=p.beta_s * factor * rng.uniform(0.9, 1.1),
                memory_bytes=int(min(p.memory_bytes * memory * rng.uniform(0.9, 1.1), 3 * GIB)),
            )
            for p in base
        )
        rate = float(rng.lognormal(math.log(fleet.rate_median), fleet.rate_sigma))
        slo = float(math.exp(rng.uniform(math.log(0.05), math.log(0.5))))
        min_copies = 2 if rng.random() < 0.1 else 1
        models.append(ModelDemand(f"m{i:04d}", rate, slo, profiles, min_copies=min_copies))
    return models


def make_nodes(count: int) -> list[NodeSpec]:
    return [
        NodeSpec(f"node{i:04d}", 8 * GIB, frozenset({"onnxruntime", "openvino"}), cores=2)
        for i in range(count)
    ]


def design_bound(models: list[ModelDemand]) -> int:
    """DESIGN.md section 5's compute bound, ``ceil(sum r*beta*L/(L - a))``."""
    total = 0.0
    for m in models:
        total += min(p.beta_s * m.rate * m.slo_s / (m.slo_s - p.a_s) for p in m.profiles)
    return math.ceil(total - 1e-9)


def first_fit_memory(models: list[ModelDemand], nodes: list[NodeSpec], headroom: Headroom) -> int:
    """First fit by decreasing memory, the same copies as ours, smallest profile."""
    alike = kinds(nodes)
    items = [i for m in models for i in split(m, alike, headroom)[0]]
    bins: list[Bin] = []
    for item in sorted(items, key=lambda i: (-i.memory, i.key)):
        for b in bins:
            fit = b.fits(item, prefer=SMALL)
            if fit is not None:
                b.add(item, fit)
                break
        else:
            b = Bin(nodes[len(bins)])
            fit = b.fits(item, prefer=SMALL)
            if fit is None:
                return -1
            b.add(item, fit)
            bins.append(b)
    return len(bins)


def copies_needed(models: list[ModelDemand], nodes: list[NodeSpec], headroom: Headroom) -> int:
    alike = kinds(nodes)
    return sum(len(split(m, alike, headroom)[0]) for m in models)


def modelmesh(models: list[ModelDemand], headroom: Headroom, start: int) -> int:
    """Servers ModelMesh's placement needs before no server's compute is over 100%."""

    def feasible(count: int) -> bool:
        free = [8 * GIB] * count
        held: list[list[tuple[ModelDemand, float]]] = [[] for _ in range(count)]
        for m in sorted(models, key=lambda m: (-m.rate, m.name)):
            per_min = m.rate * 60
            copies = 1 if per_min < 1 else max(2, math.ceil(per_min / 2000))
            copies = min(max(copies, m.min_copies), count)
            need = m.profiles[0].memory_bytes
            for _ in range(copies):
                room = [
                    s
                    for s in range(count)
                    if free[s] >= need and all(h[0] is not m for h in held[s])
                ]
                if not room:
                    return False
                s = min(room, key=lambda s: (len(held[s]), -free[s], s))
                free[s] -= need
                held[s].append((m, m.rate / copies))
        for entries in held:
            slots = [size(m.profiles[0], r, m.slo_s, 1.0, headroom) for m, r in entries]
            if not fits(slots):
                return False
        return True

    lo, hi = max(1, start), max(1, start)
    while not feasible(hi):
        lo, hi = hi + 1, hi * 2
        if hi > 100_000:
            return -1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


POISSON, BURSTY = Headroom(), Headroom(cv=2.0)


def floor_nodes(placement: Placement, models: list[ModelDemand], nodes: list[NodeSpec]) -> float:
    """Node time the copies need at their own least share, summed (not a bound on other
    packings: a yardstick for this one's packing and burst allowance)."""
    demands = {m.name: m for m in models}
    speeds = {n.name: n.speed for n in nodes}
    total = 0.0
    for c in placement.copies:
        demand = demands[c.model]
        profile = demand.profile_for(c.backend)
        assert profile is not None
        total += size(profile, c.rate, demand.slo_s, speeds[c.node], POISSON).floor
    return total


def part_a(measured, fleets, lines: list[str]) -> tuple[bool, dict[str, tuple]]:
    ok = True
    made: dict[str, tuple] = {}
    lines.append(
        "(a) nodes used, planned for 99% of requests in time under Poisson arrivals "
        "(lower bound = max(compute, memory))"
    )
    head = (
        f"{'fleet':<20}{'copies':>7}{'LB c/m':>10}{'DESIGN':>8}{'floor':>7}{'ours':>6}{'/LB':>6}"
        f"{'FF-mem':>8}{'/LB':>6}{'1/node':>8}{'/LB':>6}{'MMesh':>7}{'/LB':>6}{'time':>7}"
    )
    lines.append(head)
    for fleet in fleets:
        models = make_fleet(fleet, measured)
        nodes = make_nodes(2 * len(models) + 50)
        started = time.perf_counter()
        placement = place(models, nodes, headroom=POISSON)
        took = time.perf_counter() - started
        made[fleet.name] = (models, nodes, placement)
        problems = check(placement, models, nodes, POISSON)
        bounds = placement.bounds or lower_bounds(models, nodes, POISSON)
        lb = bounds.nodes
        ours = len(placement.nodes_used())
        floor = floor_nodes(placement, models, nodes)
        ff = first_fit_memory(models, nodes, POISSON)
        single = copies_needed(models, nodes, POISSON)
        mesh = modelmesh(models, POISSON, lb)
        lines.append(
            f"{fleet.name:<20}{len(placement.copies):>7}{bounds.compute:>5}/{bounds.memory:<4}"
            f"{design_bound(models):>8}{math.ceil(floor - 1e-9):>7}{ours:>6}{ours / lb:>6.2f}"
            f"{ff:>8}{ff / lb:>6.2f}{single:>8}{single / lb:>6.2f}{mesh:>7}{mesh / lb:>6.2f}"
            f"{took:>6.1f}s"
        )
        if problems:
            ok = False
            lines.append(f"    MISS: {len(problems)} invariants broken: {problems[:3]}")
        if placement.unplaced:
            ok = False
            lines.append(f"    MISS: unplaced {dict(list(placement.unplaced.items())[:3])}")
        if ours > TARGET * lb:
            ok = False
            compute, memory = bound_sums(models, nodes, POISSON)
            lines.append(
                f"    MISS: {ours} nodes is {ours / lb:.2f}x the bound {lb} (> {TARGET}): the "
                f"bound before rounding is {max(compute, memory):.2f} nodes (any schedule, even "
                f"one that knows every arrival and batches each model over its whole "
                f"objective); our copies' least node time is {floor:.2f} "
                f"({floor / max(compute, memory):.2f}x the bound), and the turns' planning "
                f"margins (99% of each model's requests in time with the cycle's spread, batches "
                f"within max_batch) and packing take the rest ({ours / floor:.2f}x)"
            )
    return ok, made


#: (arrivals CV, plan, is it the target row)
PLANS = ((1.0, MEANS, False), (1.0, POISSON, True), (2.0, POISSON, False), (2.0, BURSTY, True))


def part_b(made: dict[str, tuple], quick: bool, lines: list[str]) -> bool:
    ok = True
    lines.append("")
    lines.append(
        "(b) simulated as Ferry's nodes serve, share of requests within the SLO (target: "
        ">= 99% for every model, and nodes <= 1.10x the bound for that traffic (/LB), on the "
        "* rows)"
    )
    lines.append(
        f"{'fleet':<20}{'arrivals':<12}{'plan':<13}{'nodes':>6}{'LB':>5}{'/LB':>6}"
        f"{'requests':>12}{'fewest':>7}{'all':>9}{'worst model':>22}{'sim':>7}"
    )
    for name, (models, nodes, ours) in made.items():
        if "memory" in name:
            continue  # placement only: models at 0.02 req/s, and compute is not what binds
        for cv, headroom, target in PLANS:
            placement = ours if headroom == POISSON else place(models, nodes, headroom=headroom)
            traffic = POISSON if cv == 1.0 else BURSTY
            lb = lower_bounds(models, nodes, traffic).nodes
            used = len(placement.nodes_used())
            started = time.perf_counter()
            result = simulate(placement, models, nodes, cv=cv, quick=quick, seed=7)
            took = time.perf_counter() - started
            worst_model, worst = result.worst()
            arrivals = "Poisson" if cv == 1.0 else f"Gamma CV {cv:g}"
            plan = "means" if headroom == MEANS else f"q{headroom.quantile:g} cv{headroom.cv:g}"
            lines.append(
                f"{name:<20}{arrivals:<12}{plan + (' *' if target else ''):<13}{used:>6}{lb:>5}"
                f"{used / lb:>6.2f}{result.total:>12,}{result.fewest:>7}{result.overall:>9.2%}"
                f"{worst_model:>13} {worst:>8.2%}{took:>6.1f}s"
            )
            if not target:
                continue
            if placement.unplaced or check(placement, models, nodes, headroom):
                ok = False
                lines.append("    MISS: the placement is not complete and valid")
            if worst < 0.99:
                ok = False
                lines.append(f"    MISS: {worst_model} had {worst:.2%} within its SLO (< 99%)")
            if cv != 1.0 and used > TARGET * lb:
                # (the placement that holds bursty traffic is held to the bound as well: the
                # one graded in (a) had never been asked to survive Gamma CV 2)
                ok = False
                lines.append(
                    f"    MISS: bursty: {used} nodes is {used / lb:.2f}x its bound {lb} "
                    f"(> {TARGET:.2f}x)"
                )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter simulation")
    parser.add_argument("--profiles", type=Path, help="profiles JSON from ferry-cloud tune")
    parser.add_argument("--no-live", action="store_true", help="skip (c), the live fleet")
    args = parser.parse_args(argv)
    measured = load_profiles(args.profiles)
    lines: list[str] = []
    ok_a, made = part_a(measured, FLEETS, lines)
    print("\n".join(lines), flush=True)
    lines.clear()
    ok_b = part_b(made, args.quick, lines)
    print("\n".join(lines), flush=True)
    ok = ok_a and ok_b
    if not args.no_live:
        from bench._packing_live import run_live

        ok_c, live = run_live()
        print("\n" + "\n".join(live))
        ok = ok and ok_c
    print("\nall targets met" if ok else "\nMISSED a target (see MISS lines)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
