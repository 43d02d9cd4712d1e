"""The scenario grid of bench/policy_quality.py: cells, traces, replays, decision timing.

See bench/policy_quality.py for what is measured and why.  Workers of the
process pool are forked after :func:`install`, so they share the measured
profile and the loaded traces without pickling them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from devices.profiles import DeviceProfile, load_device, load_link
from edge.config import load_policy_file
from edge.core import NATIVE
from edge.core.estimators import Estimators
from edge.core.policy import Context, Policy, PolicyConfig
from edge.evaluation.evaluate import BASELINES, ComputeProfile, Range, Workload, evaluate, summarize
from edge.netem.traces import Trace, commute, load_trace, markov_fading, steady

ROOT = Path(__file__).resolve().parent.parent
MODEL = "orientation"
LINK = "lte"
DEVICES = {"pi4b": "raspberry-pi-4b", "orin": "jetson-orin-nano"}  # the example; a faster one
COMPUTE = (1.0, 3.0, 10.0)  # the example as measured, 3x and 10x heavier (local and cloud)
# Bytes up per request: an encoded image (uniform 20-100 KB per request) or the raw
# 1x3x224x224 FP32 tensor (602,112 B) plus the agent's ~256 B envelope.
SIZES: dict[str, float | Range] = {"enc": Range(20_000, 100_000), "raw": 602_368}
REPLY_BYTES = 1_024
TIGHT = (1.5, 0.3)  # deadline: max(1.5 x local p95, 0.3 s): a warm-radio offload fits
LOOSE = (4.0, 1.0)  # max(4 x local p95, 1 s): the example's 1000 ms at least
TIE = 0.01  # ours within +-1% of the best baseline is a tie (and meets the +1% target)
POLICIES = ("ferry", *BASELINES, "oracle")


@dataclass(frozen=True)
class Cell:
    device: str  # key of DEVICES
    compute: float  # factor on the measured local and cloud compute times
    size: str  # key of SIZES
    deadline: str  # "tight" | "loose"
    deadline_ms: float
    energy_j: float  # the weight per joule
    trace: str

    def label(self) -> str:
        return (
            f"{self.device} {self.compute:g}x {self.size} {self.deadline} "
            f"{self.deadline_ms:.0f}ms e={self.energy_j:g} {self.trace}"
        )


@dataclass
class Setup:
    local_s: tuple[float, ...]  # measured on this host (int8, one thread)
    cloud_s: tuple[float, ...]  # measured on this host (FP32)
    confidences: tuple[float, ...]
    pairs: dict[str, tuple[Trace, Trace]]
    policy: PolicyConfig  # examples/agent.toml's [policy] and [models.*]
    duration_s: float  # cap on each replay's length
    rate: float
    seeds: int
    transports: tuple[str, ...]
    # The local model's runtime takes a cancel (the example's ONNX Runtime does):
    # a race's local run stops when the cloud answers first.
    local_cancellable: bool = False


_SETUP: Setup | None = None


def install(setup: Setup) -> None:
    """Make ``setup`` the one :func:`run_cell` reads (call before forking the workers)."""
    global _SETUP
    _SETUP = setup


def example_policy(repo: Path) -> PolicyConfig:
    return load_policy_file(repo / "examples" / "agent.toml")


def trace_pairs(folder: Path, seconds: float) -> dict[str, tuple[Trace, Trace]]:
    """Every ``NAME.up``/``NAME.down`` pair in ``folder``, then the synthetic ones."""
    pairs: dict[str, tuple[Trace, Trace]] = {}
    if folder.is_dir():
        for up in sorted(folder.glob("*.up")):
            down = up.with_suffix(".down")
            if down.exists():
                pairs[up.stem] = (load_trace(up), load_trace(down))
    if not pairs:
        print(f"NOTICE: no real trace pairs in {folder}: synthetic traces only")
    pairs["synth-steady"] = (steady(8.0, seconds, "steady-8"), steady(30.0, seconds, "steady-30"))
    pairs["synth-markov-off"] = (
        markov_fading(seconds, seed=1, bad_mbps=0.0, name="markov-1-off"),
        markov_fading(seconds, seed=2, good_mbps=30, bad_mbps=0.0, name="markov-2-off"),
    )
    pairs["synth-commute"] = (commute(seconds, seed=3), commute(seconds, seed=4))
    return pairs


def local_p95_s(local_s: tuple[float, ...], device: DeviceProfile, compute: float) -> float:
    return float(np.percentile(np.asarray(local_s) * compute * device.speed_factor, 95))


def deadlines_ms(local_s: tuple[float, ...], device: str, compute: float) -> dict[str, float]:
    p95 = local_p95_s(local_s, load_device(DEVICES[device]), compute)
    return {
        "tight": 1000 * max(TIGHT[0] * p95, TIGHT[1]),
        "loose": 1000 * max(LOOSE[0] * p95, LOOSE[1]),
    }


def build_grid(
    setup: Setup,
    devices: tuple[str, ...],
    computes: tuple[float, ...],
    sizes: tuple[str, ...],
    energies: tuple[float, ...],
    traces: tuple[str, ...],
) -> list[Cell]:
    cells = []
    for dev in devices:
        for k in computes:
            dls = deadlines_ms(setup.local_s, dev, k)
            for size in sizes:
                for name, ms in dls.items():
                    for e in energies:
                        cells.extend(Cell(dev, k, size, name, ms, e, tr) for tr in traces)
    return cells


def _evaluate(setup: Setup, cell: Cell, seed: int) -> Any:
    device = load_device(DEVICES[cell.device])
    k = cell.compute
    profile = ComputeProfile(
        tuple(x * k for x in setup.local_s),
        tuple(x * k for x in setup.cloud_s),
        setup.confidences,
        device.speed_factor,
        setup.local_cancellable,
    )
    config = replace(setup.policy, weights=replace(setup.policy.weights, energy_j=cell.energy_j))
    up, down = setup.pairs[cell.trace]
    duration = min(max(up.period_ms, down.period_ms) / 1000.0, setup.duration_s)
    workload = Workload(
        count=max(round(duration * setup.rate), 1),
        rate_per_s=setup.rate,
        input_bytes=SIZES[cell.size],
        output_bytes=REPLY_BYTES,
        deadline_ms=cell.deadline_ms,
        seed=seed,
    )
    return evaluate(
        up=up,
        down=down,
        link=load_link(LINK),
        device=device,
        profile=profile,
        config=config,
        model=MODEL,
        workload=workload,
        transports=setup.transports,
    )


def run_cell(cell: Cell) -> dict[str, Any]:
    """Every policy's figures for ``cell``, pooled over the seeds (equal counts per seed)."""
    setup = _SETUP
    assert setup is not None, "install() a Setup first"
    per: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    requests, static = 0, set()
    for seed in range(setup.seeds):
        ev = _evaluate(setup, cell, seed)
        for name in POLICIES:
            per[name].append(summarize(ev.sim, ev.results[name]))
        requests += len(ev.results["ferry"].outcomes)
        static.add(ev.static_choice)
    keys = ("mean_cost", "miss_rate", "offload_share", "overlap_share", "probes")
    pooled = {n: {k: float(np.mean([s[k] for s in v])) for k in keys} for n, v in per.items()}
    oracle = pooled["oracle"]["mean_cost"]
    best = min(BASELINES, key=lambda n: pooled[n]["mean_cost"])
    ours, best_cost = pooled["ferry"]["mean_cost"], pooled[best]["mean_cost"]
    vs_best = ours / best_cost
    verdict = "LOSS" if vs_best > 1 + TIE else "TIE" if vs_best >= 1 - TIE else "WIN"
    ours_miss, oracle_miss = pooled["ferry"]["miss_rate"], pooled["oracle"]["miss_rate"]
    return {
        **cell.__dict__,
        "requests": requests,
        "ours_vs_oracle": ours / oracle,
        "best": best,
        "best_vs_oracle": best_cost / oracle,
        "ours_vs_best": vs_best,
        "verdict": verdict,
        "miss_ok": oracle_miss > 0 or ours_miss < 0.01,
        "ours_miss": ours_miss,
        "oracle_miss": oracle_miss,
        "oracle_offload": pooled["oracle"]["offload_share"],
        "ours_offload": pooled["ferry"]["offload_share"],
        "ours_overlap": pooled["ferry"]["overlap_share"],
        "ours_probes": pooled["ferry"]["probes"],
        "static_choice": "/".join(sorted(static)),
        "policies": pooled,
    }


def regret_series(setup: Setup, cell: Cell, seed: int = 0) -> dict[str, Any]:
    """Arrival times and each policy's cumulative cost minus the oracle's, one replay."""
    ev = _evaluate(setup, cell, seed)
    oracle = np.array([ev.sim.cost(o) for o in ev.results["oracle"].outcomes])
    series = {}
    for name in ("ferry", *BASELINES):
        costs = np.array([ev.sim.cost(o) for o in ev.results[name].outcomes])
        series[name] = np.cumsum(costs - oracle)
    return {"t": np.asarray(ev.results["oracle"].arrivals), "regret": series}


# -- decision timing ------------------------------------------------------------------


def trained_policy(setup: Setup, compute: float = 3.0) -> tuple[Policy, float]:
    """The example policy on the Pi with mqtt and http over LTE, estimators fed some history.

    The local model runs ``compute`` x the measured time, so offloading and
    running locally are both plausible and the decision weighs three options.
    Returns the policy and a ``now`` at which no estimate is stale.
    """
    device, lte = load_device(DEVICES["pi4b"]), load_link(LINK)
    transports = ("mqtt", "http")
    mp = replace(setup.policy.models[MODEL], mode="cost", transports=transports)
    config = replace(setup.policy, models={MODEL: mp})
    est = Estimators(quantile=config.deadline_quantile)
    rng = np.random.default_rng(0)
    now = 0.0
    for tr in transports:
        est.set_link_prior(tr, lte.up_mbps * 1e6, lte.down_mbps * 1e6, lte.rtt_ms / 1000)
    for i in range(60):
        now += 0.5
        local = setup.local_s[i % len(setup.local_s)] * compute * device.speed_factor
        est.local(mp.local_model or MODEL).add(local, now)
        server = setup.cloud_s[i % len(setup.cloud_s)] * compute
        est.observe_reply(mp.cloud_model or MODEL, 200, int(server * 1e6), now)
        sent = int(rng.uniform(20_000, 100_000))
        net = lte.rtt_ms / 1000 * rng.uniform(0.8, 1.5) + sent * 8 / (lte.up_mbps * 1e6)
        est.link(transports[i % 2]).observe(sent, REPLY_BYTES, net + server, server, now)
        est.link(transports[i % 2]).observe_probe(lte.rtt_ms / 1000 * rng.uniform(0.8, 1.3), now)
    return Policy(config, est, device, {tr: lte for tr in transports}), now


def _median_us(step: Callable[[], Any], iterations: int, rounds: int = 5) -> dict[str, Any]:
    """Per-call medians of ``rounds`` rounds (the best one is the figure), pooled p50/p99.

    On a shared machine another process only ever adds time, so the least
    round median is the closest to the code's own cost; every round is kept.
    """
    for _ in range(min(iterations, 2_000)):  # warm-up: caches, allocator, CPU clock
        step()
    samples: list[int] = []
    medians = []
    per_round = max(iterations // rounds, 1)
    for _ in range(rounds):
        chunk = []
        for _ in range(per_round):
            t = time.perf_counter_ns()
            step()
            chunk.append(time.perf_counter_ns() - t)
        medians.append(statistics.median(chunk) / 1000)
        samples.extend(chunk)
    pooled = statistics.median(samples) / 1000
    return {
        # (every round's samples pooled: the best round alone had been the figure)
        "median_us": pooled,
        "round_medians_us": medians,
        "pooled_median_us": pooled,
        "p99_us": float(np.percentile(samples, 99)) / 1000,
    }


def time_decision(setup: Setup, iterations: int) -> dict[str, Any]:
    """Median us of one cost-mode decision, the per-request context included.

    Times ``EdgeCore.begin(...).start()`` (edge.core.flow, the agent's own
    per-request entry: context from the core's state, decision, fallback
    plan) when it exists and works, else ``Context(...)`` + ``Policy.decide``
    (always timed too, for comparison).
    """
    links = {"mqtt": True, "http": True}
    # The scenario where the decision is expensive: the cloud chosen on a warm radio,
    # exploration weighed.  The local time scales with this host's speed, which varies
    # several-fold: on a fast state the local run won on both paths (the cheap path was
    # timed), so the model is made heavier until the warm radio offloads.
    from edge.core.flow import EdgeCore

    compute = 3.0
    for _ in range(8):
        policy, now = trained_policy(setup, compute)
        core = EdgeCore(policy, tuple(links))
        core.radio._last_end = now + 0.02 - 1.0
        action = core.begin(MODEL, now=now + 0.02, in_bytes=60_000, connected=links).start()
        option = getattr(action, "option", None)
        if option is not None and option.transport is not None:
            break
        compute *= 2

    def bare() -> Any:
        ctx = Context(
            now=now,
            deadline_s=1.0,
            in_bytes=60_000,
            connected=links,
            radio_idle_s=1.0,
            out_bytes=REPLY_BYTES,
        )
        return policy.decide(MODEL, ctx)

    decision = bare()
    out: dict[str, Any] = {
        "entry": "Context(...) + Policy.decide",
        "choice": decision.where,
        "options": [f"{o.name} {o.cost:.3f}" for o in decision.options],
        "iterations": iterations,
    }
    out["bare"] = _median_us(bare, iterations)
    out.update(out["bare"])
    out["compute"] = compute  # (x the measured local time, on the Pi)

    # The agent's per-request entry on its expensive paths: requests 20 ms apart
    # (so the rate is known and radio tails are priced forwards), the radio up
    # from the last transfer (cloud chosen, exploration weighed) or gone to sleep
    # (the wake-up rule weighed); the slower of the two is the figure.
    paths: dict[str, dict[str, Any]] = {}
    for radio, last in (("warm", 1.0), ("cold", 60.0)):
        core = EdgeCore(policy, tuple(links))
        clock = [now]

        def flow(core: EdgeCore = core, clock: list[float] = clock, last: float = last) -> Any:
            clock[0] += 0.02
            core.radio._last_end = clock[0] - last
            return core.begin(MODEL, now=clock[0], in_bytes=60_000, connected=links).start()

        action = flow()
        option = getattr(action, "option", None)
        paths[radio] = {
            "choice": option.name if option is not None else type(action).__name__,
            **_median_us(flow, iterations),
        }
    slow = max(paths, key=lambda k: paths[k]["median_us"])
    out.update(paths[slow])
    out["paths"] = {k: (v["choice"], round(v["median_us"], 1)) for k, v in paths.items()}
    out["entry"] = f"EdgeCore.begin(...).start(), {slow} radio"
    out["core"] = NATIVE
    return out


def time_decision_python(setup: Setup, iterations: int) -> dict[str, Any] | None:
    """:func:`time_decision` on the core's Python sources (FERRY_NATIVE=0), in a child
    process: the compiled core's figure beside the one it replaces.  None where this
    process runs the Python sources already (the figure is the same)."""
    if not NATIVE.startswith("compiled"):
        return None
    doc = {"local_s": setup.local_s, "cloud_s": setup.cloud_s, "n": iterations}
    code = (
        "import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "import _policy_grid as g\n"
        "d = json.loads(sys.argv[3])\n"
        "s = g.Setup(tuple(d['local_s']), tuple(d['cloud_s']), (), {}, "
        "g.example_policy(g.ROOT), 1.0, 1.0, 1, ('mqtt', 'http'))\n"
        "print(json.dumps(g.time_decision(s, d['n'])))\n"
    )
    env = {**os.environ, "FERRY_NATIVE": "0"}
    argv = [sys.executable, "-c", code, str(ROOT / "bench"), str(ROOT), json.dumps(doc)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
