"""The replay evaluator: the oracle bounds every policy; ours adapts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from devices.profiles import load_device, load_link
from edge.evaluate import ComputeProfile, Workload, evaluate, summarize
from edge.policy import ModelPolicy, PolicyConfig, Weights
from edge.traces import commute, markov_fading, steady
from tests.support import ROOT

CONFIG = PolicyConfig(
    weights=Weights(latency_s=1.0, energy_j=0.005, data_mb=0.001),
    models={"m": ModelPolicy(local_model="m-int8", cloud_model="m")},
)
# Measured shapes: a light CNN locally (~25 ms here), 6 ms in the cloud.
LOCAL = tuple(np.random.default_rng(0).lognormal(np.log(0.025), 0.2, 200))
CLOUD = tuple(np.random.default_rng(1).lognormal(np.log(0.006), 0.2, 200))


def _run(
    up,
    down,
    *,
    speed: float,
    deadline_ms: float,
    count: int = 200,
    seed: int = 0,
    device: str = "raspberry-pi-4b",
):
    profile = ComputeProfile(LOCAL, tuple(c * speed / 8 for c in CLOUD), (0.9, 0.5), speed)
    wl = Workload(count=count, input_bytes=60_000, deadline_ms=deadline_ms, seed=seed)
    return evaluate(
        up=up,
        down=down,
        link=load_link("lte"),
        device=load_device(device),
        profile=profile,
        config=CONFIG,
        model="m",
        workload=wl,
    )


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    speed=st.sampled_from([0.1, 8.0, 32.0]),
    deadline_ms=st.sampled_from([200.0, 400.0, 1000.0]),
    kind=st.sampled_from(["steady", "markov", "commute"]),
)
def test_the_oracle_is_never_beaten(seed, speed, deadline_ms, kind):
    up = {
        "steady": steady(6.0, 60),
        "markov": markov_fading(120, seed=seed),
        "commute": commute(120, seed=seed),
    }[kind]
    sim, results = _run(
        up, steady(20.0, 60), speed=speed, deadline_ms=deadline_ms, count=80, seed=seed
    )
    oracle = results["oracle"].outcomes
    for name, result in results.items():
        for mine, best in zip(result.outcomes, oracle, strict=True):
            assert sim.cost(mine) >= sim.cost(best) - 1e-12, name


def test_ours_costs_no_more_than_any_baseline_on_the_commute():
    for speed, deadline in ((8.0, 400.0), (32.0, 1000.0)):
        sim, results = _run(
            commute(300, seed=3), commute(300, seed=4), speed=speed, deadline_ms=deadline, count=300
        )
        costs = {name: summarize(sim, r)["mean_cost"] for name, r in results.items()}
        for name in ("always-local", "always-cloud", "static (Neurosurgeon)", "cascade (Sedna)"):
            assert costs["ferry"] <= costs[name] + 1e-9, (speed, name, costs)


def test_replay_is_deterministic_given_a_seed():
    a = _run(commute(120, seed=1), steady(20, 60), speed=32.0, deadline_ms=1000, seed=5)
    b = _run(commute(120, seed=1), steady(20, 60), speed=32.0, deadline_ms=1000, seed=5)
    assert [o.where for o in a[1]["ferry"].outcomes] == [o.where for o in b[1]["ferry"].outcomes]
    assert summarize(a[0], a[1]["ferry"]) == summarize(b[0], b[1]["ferry"])


def test_evaluate_command_writes_a_table_and_plots(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps({"local_s": list(LOCAL), "cloud_s": list(CLOUD), "confidences": [0.9]})
    )
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[policy.weights]\nlatency_s = 1.0\n[models.m]\nlocal = "m-int8"\ncloud = "m"\n'
    )
    workload = tmp_path / "workload.toml"
    workload.write_text(
        'count = 100\narrival = "periodic"\nrate_per_s = 2.0\ninput_bytes = 60000\ndeadline_ms = 500\n'
    )
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge.cli",
            "evaluate",
            "--policy",
            str(policy),
            "--device",
            "raspberry-pi-4b",
            "--link",
            "lte",
            "--up",
            "commute:7",
            "--down",
            "steady:20",
            "--model",
            "m",
            "--workload",
            str(workload),
            "--profile",
            str(profile),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = (out / "report.md").read_text()
    for name in (
        "ferry",
        "always-local",
        "always-cloud",
        "static (Neurosurgeon)",
        "cascade (Sedna)",
        "oracle",
    ):
        assert f"| {name} |" in report
    assert (out / "cost.png").stat().st_size > 1000 and (out / "choices.png").stat().st_size > 1000


def test_bad_workload_key_is_a_clear_error(tmp_path):
    workload = tmp_path / "w.toml"
    workload.write_text("counts = 3\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge.cli",
            "evaluate",
            "--policy",
            str(workload),
            "--up",
            "steady:5",
            "--model",
            "m",
            "--workload",
            str(workload),
            "--profile",
            str(workload),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown key 'counts'" in proc.stderr
