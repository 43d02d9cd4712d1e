"""The replay evaluator: the oracle bounds every policy; ours adapts; the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devices.profiles import load_device, load_link
from edge.core.policy import ModelPolicy, PolicyConfig, Weights
from edge.evaluation.baselines import run_bound
from edge.evaluation.evaluate import BASELINES, ComputeProfile, Workload, evaluate, summarize
from edge.evaluation.report import plots
from edge.evaluation.sim import Result, no_answer
from edge.netem.traces import commute, load_trace, markov_fading, steady
from shared.errors import BackendMissing
from tests.support import ROOT, cellular_trace_dir, cellular_trace_pairs

# Measured shapes: a light CNN on one development-machine core (~25 ms), 6 ms in the cloud.
LOCAL = tuple(np.random.default_rng(0).lognormal(np.log(0.025), 0.2, 200))
CLOUD = tuple(np.random.default_rng(1).lognormal(np.log(0.006), 0.2, 200))


def _config(weights: Weights, mode: str = "cost", **policy: object) -> PolicyConfig:
    return PolicyConfig(
        weights=weights,
        models={
            "m": ModelPolicy(mode=mode, local_model="m-int8", cloud_model="m", transports=("mqtt",))
        },
        **policy,
    )


def _run(up, down, *, device="raspberry-pi-4b", heavier=1.0, config=None, **workload):
    dev = load_device(device)
    profile = ComputeProfile(
        tuple(x * heavier for x in LOCAL),
        tuple(x * heavier for x in CLOUD),
        (0.95, 0.6),
        dev.speed_factor,
    )
    return evaluate(
        up=up,
        down=down,
        link=load_link("lte"),
        device=dev,
        profile=profile,
        config=config or _config(Weights(latency_s=1.0, energy_j=0.005, data_mb=0.001)),
        model="m",
        workload=Workload(**workload),
    )


def _assert_the_oracle_is_never_beaten(ev) -> None:
    """The oracle's schedule costs no more than any policy's; the bound, no request more."""
    cost = ev.sim.cost
    oracle = sum(cost(o) for o in ev.results["oracle"].outcomes)
    bound = run_bound(ev.sim).outcomes
    for name, result in ev.results.items():
        total = sum(cost(o) for o in result.outcomes)
        assert total >= oracle - 1e-9 * max(1.0, abs(oracle)), (name, total, oracle)
        for i, (mine, least) in enumerate(zip(result.outcomes, bound, strict=True)):
            assert cost(mine) >= cost(least) - 1e-12, (name, i, mine, least)


WEIGHTS = st.sampled_from(
    [
        Weights(latency_s=1.0),
        Weights(latency_s=1.0, energy_j=0.005, data_mb=0.001),
        Weights(latency_s=0.2, energy_j=0.05, money=1.0),
        Weights(energy_j=1.0),
    ]
)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["steady", "markov-off", "commute"]),
    device=st.sampled_from(["raspberry-pi-4b", "jetson-orin-nano", "x86-laptop"]),
    heavier=st.sampled_from([1.0, 5.0, 20.0]),
    deadline_ms=st.sampled_from([200.0, 1000.0, 3000.0]),
    weights=WEIGHTS,
    mode=st.sampled_from(["cost", "cost", "cascade", "cloud"]),
    input_bytes=st.sampled_from([60_000, 602_368]),
    rate=st.sampled_from([0.3, 2.0]),
)
def test_the_oracle_is_never_beaten(
    seed, kind, device, heavier, deadline_ms, weights, mode, input_bytes, rate
):
    up = {
        "steady": steady(6.0, 60),
        "markov-off": markov_fading(120, seed=seed, bad_mbps=0.0),
        "commute": commute(120, seed=seed),
    }[kind]
    ev = _run(
        up,
        steady(20.0, 60),
        device=device,
        heavier=heavier,
        config=_config(weights, mode, data_cap_mb_per_day=20.0),
        count=60,
        seed=seed,
        deadline_ms=deadline_ms,
        input_bytes=input_bytes,
        rate_per_s=rate,
        battery_percent=12.0 if device == "x86-laptop" else None,
    )
    _assert_the_oracle_is_never_beaten(ev)


@pytest.mark.parametrize("name", cellular_trace_pairs())
def test_the_oracle_is_never_beaten_on_the_real_traces(name):
    folder = cellular_trace_dir()
    up, down = load_trace(folder / f"{name}.up"), load_trace(folder / f"{name}.down")
    cases = [
        ("raspberry-pi-4b", 5.0, 3000.0, Weights(latency_s=1.0, energy_j=0.005, data_mb=0.001)),
        ("jetson-orin-nano", 1.0, 500.0, Weights(latency_s=1.0)),
        ("x86-laptop", 20.0, 1500.0, Weights(latency_s=0.5, energy_j=0.05, money=1.0)),
    ]
    for device, heavier, deadline_ms, weights in cases:
        ev = _run(
            up,
            down,
            device=device,
            heavier=heavier,
            config=_config(weights),
            count=150,
            rate_per_s=150 / (up.period_ms / 1000),  # spread over the whole trace
            deadline_ms=deadline_ms,
        )
        _assert_the_oracle_is_never_beaten(ev)


@pytest.mark.parametrize(
    ("device", "heavier", "input_bytes"),
    [
        # the real Pi profile, a model ~5x the light CNN (~1 s there), its FP32 image input
        ("raspberry-pi-4b", 5.0, 602_368),
        ("raspberry-pi-4b", 5.0, 60_000),
        ("x86-laptop", 20.0, 60_000),
    ],
)
def test_ours_costs_no_more_than_any_baseline_on_the_commute(device, heavier, input_bytes):
    ev = _run(
        commute(300, seed=3),
        commute(300, seed=4),
        device=device,
        heavier=heavier,
        count=150,
        rate_per_s=0.5,
        deadline_ms=3000.0,
        input_bytes=input_bytes,
    )
    stats = {name: summarize(ev.sim, r) for name, r in ev.results.items()}
    # non-trivial: good WiFi, weak LTE and a tunnel make ours both offload and stay local
    assert 0.1 < stats["ferry"]["offload_share"] < 0.95, stats["ferry"]
    for name in BASELINES:
        assert stats["ferry"]["mean_cost"] <= stats[name]["mean_cost"], (name, stats)


def test_replay_is_deterministic_given_a_seed():
    def run():
        return _run(
            commute(120, seed=1), steady(20, 60), heavier=5.0, count=100, seed=5, deadline_ms=3000.0
        )

    a, b = run(), run()
    assert [o.where for o in a.results["ferry"].outcomes] == [
        o.where for o in b.results["ferry"].outcomes
    ]
    assert summarize(a.sim, a.results["ferry"]) == summarize(b.sim, b.results["ferry"])


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge.cli", "evaluate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _inputs(tmp_path: Path) -> list[str]:
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
        'count = 100\narrival = "periodic"\nrate_per_s = 2.0\ninput_bytes = [60000, 120000]\n'
        "deadline_ms = 500\n"
    )
    return [
        "--policy",
        str(policy),
        "--device",
        "raspberry-pi-4b",
        "--link",
        "lte",
        "--model",
        "m",
        "--workload",
        str(workload),
        "--profile",
        str(profile),
    ]


def test_evaluate_command_writes_a_table_and_plots(tmp_path):
    out = tmp_path / "report"
    proc = _cli(*_inputs(tmp_path), "--up", "commute:7", "--down", "steady:20", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = (out / "report.md").read_text()
    for name in ("ferry", *BASELINES, "oracle"):
        assert f"| {name} |" in report
    assert "requests do not share the link" in report  # the model's simplification is stated
    assert (out / "cost.png").stat().st_size > 1000 and (out / "choices.png").stat().st_size > 1000


def test_evaluate_without_a_downlink_trace_says_it_uses_the_link_profiles_rate(tmp_path):
    proc = _cli(*_inputs(tmp_path), "--up", "markov-off:2")
    assert proc.returncode == 0, proc.stderr
    assert "downlink steady:13 (link profile 'lte', no --down)" in proc.stdout


def test_plots_without_matplotlib_name_the_eval_extra(tmp_path, monkeypatch):
    ev = _run(steady(8, 30), steady(20, 30), count=5)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(BackendMissing, match=r"pip install 'ferry\[eval\]'"):
        plots(ev.sim, ev.results, tmp_path, "t")


def test_bad_workload_key_is_a_clear_error(tmp_path):
    workload = tmp_path / "w.toml"
    workload.write_text("counts = 3\n")
    proc = _cli(
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
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown key 'counts'" in proc.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--model": "nosuch"}, "--model: 'nosuch' is not in"),
        ({"--miss-penalty": "-5"}, "--miss-penalty"),
        ({"--probe-interval-s": "0"}, "--probe-interval-s"),
        ({"--seed": "-1"}, "--seed"),
    ],
)
def test_evaluate_refuses_a_model_the_policy_lacks_and_nonsense_numbers(
    tmp_path, change: dict, message: str
):
    args = _inputs(tmp_path)
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_replay(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = _cli(*_inputs(tmp_path), "--up", "steady:5", "--out", str(blocker / "report"))
    assert proc.returncode == 2 and "--out" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _deadlines_of(args: list[str]) -> str:
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stdout.splitlines() if line.startswith("| ferry |"))


def test_a_workload_without_deadlines_takes_the_policy_files(tmp_path):
    args = _inputs(tmp_path)
    workload = Path(args[args.index("--workload") + 1])
    workload.write_text(workload.read_text().replace("deadline_ms = 500\n", ""))
    policy = Path(args[args.index("--policy") + 1])
    rows = []
    for deadline in (100, 5000):
        policy.write_text(
            f"[policy]\ndeadline_ms = {deadline}\n" + policy.read_text().split("\n", 2)[-1]
        )
        rows.append(_deadlines_of(args))
    assert rows[0] != rows[1]  # 100 ms misses what 5 s does not


def test_a_one_line_uplink_trace_keeps_the_profiles_downlink_rate(tmp_path):
    trace = tmp_path / "one.mm"
    trace.write_text("1\n")
    proc = _cli(*_inputs(tmp_path), "--up", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert "(link profile 'lte', no --down) (13.00 Mbps mean)" in proc.stdout


def test_a_timestamp_past_int64_is_a_clear_error(tmp_path):
    trace = tmp_path / "huge.mm"
    trace.write_text("99999999999999999999\n")
    proc = _cli(*_inputs(tmp_path), "--up", str(trace))
    assert proc.returncode == 2 and "huge.mm:1" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_link_comes_from_the_files_links_unless_given(tmp_path):
    args = _inputs(tmp_path)
    policy = Path(args[args.index("--policy") + 1])
    policy.write_text(
        '[cloud]\nhttp = "http://c:8000"\n[links]\nhttp = "wifi"\n' + policy.read_text()
    )
    without = list(args)
    del without[without.index("--link") : without.index("--link") + 2]
    proc = _cli(*without, "--up", "steady:5")
    assert proc.returncode == 0, proc.stderr
    assert "wifi link" in proc.stdout
    proc = _cli(*args, "--up", "steady:5")  # --link lte: said to replace the file's
    assert proc.returncode == 0 and "replaces the file's [links] (http = 'wifi')" in proc.stdout
    policy.write_text(
        policy.read_text()
        .replace(
            '[cloud]\nhttp = "http://c:8000"\n',
            '[cloud]\nhttp = "http://c:8000"\nmqtt = "mqtt://c"\n',
        )
        .replace('[links]\nhttp = "wifi"\n', '[links]\nhttp = "wifi"\nmqtt = "lte"\n')
    )
    proc = _cli(*without, "--up", "steady:5")
    assert proc.returncode == 2 and "one radio" in proc.stderr, proc.stderr


def test_the_report_says_what_its_comparison_leaves_out(tmp_path):
    """A model whose transports have no endpoint never offloads, and a data cap binds
    ours alone: both went unsaid (ours at 3.2x an oracle that broke the cap)."""
    args = _inputs(tmp_path)
    policy = Path(args[args.index("--policy") + 1])
    policy.write_text(
        policy.read_text().replace('cloud = "m"\n', 'cloud = "m"\ntransports = ["mqtt"]\n')
        + "[policy]\ndata_cap_mb_per_day = 5\n"
    )
    proc = _cli(*args, "--up", "steady:5", "--transports", "http")
    assert proc.returncode == 0, proc.stderr
    assert "transports ['mqtt'] have no endpoint (there are ['http']): it never offloads" in (
        proc.stdout
    )
    assert "keeps the data cap (5 MB a day)" in proc.stdout
    proc = _cli(*args, "--up", "steady:5")  # (every transport reachable)
    assert "never offloads" not in proc.stdout


def test_an_agent_warns_of_a_model_whose_transports_have_no_endpoint(caplog):
    from edge.config import parse_agent_config

    config = parse_agent_config(
        'repository = "r"\n[cloud]\nhttp = "http://c:8000"\n'
        '[models.m]\nlocal = "m-int8"\ncloud = "m"\ntransports = ["mqtt"]\n',
        "agent.toml",
        Path("."),
    )
    from edge.config import unreachable_transports

    assert unreachable_transports(config.policy, ["http"]) == [
        "model 'm': its transports ['mqtt'] have no endpoint (there are ['http']): it never "
        "offloads"
    ]
    assert unreachable_transports(config.policy, None) == []  # (the replay's "any")
    assert "[cloud] names none" in unreachable_transports(config.policy, [])[0]


def test_an_unanswered_request_counts_its_deadline_in_the_latency_figures():
    ev = _run(steady(8, 30), steady(20, 30), count=5)
    stats = summarize(ev.sim, Result("refuses", [no_answer(0.5), no_answer(0.5, 0.2)]))
    assert stats["p50_ms"] == pytest.approx(500.0) and stats["miss_rate"] == 1.0


def test_a_cloud_attempt_that_never_came_back_is_not_counted_as_offloaded():
    """Over a link with no capacity always-cloud answered nothing, yet showed 100%
    offloaded beside 0 MB sent, while ours' fallbacks showed as local: one column, two
    meanings."""
    ev = _run(steady(0, 30), steady(20, 30), count=5)
    stats = summarize(ev.sim, ev.results["always-cloud"])
    assert stats["offload_share"] == 0.0 and stats["miss_rate"] == 1.0
    assert stats["p50_ms"] >= min(o.deadline_s for o in ev.results["always-cloud"].outcomes) * 1000


def test_a_link_profile_beside_the_policy_file_is_read_from_there(tmp_path):
    """Paths in [links] resolve against the file's folder, as the agent reads them."""
    args = _inputs(tmp_path)
    policy = Path(args[args.index("--policy") + 1])
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "mylink.toml").write_text((ROOT / "devices" / "links" / "wifi.toml").read_text())
    (sub / "policy.toml").write_text('[links]\nhttp = "mylink.toml"\n' + policy.read_text())
    args[args.index("--policy") + 1] = str(sub / "policy.toml")
    del args[args.index("--link") : args.index("--link") + 2]
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 0, proc.stderr
    assert "wifi link" in proc.stdout


def test_the_files_device_is_the_default_and_its_probe_interval_is_checked(tmp_path):
    args = _inputs(tmp_path)
    policy = Path(args[args.index("--policy") + 1])
    del args[args.index("--device") : args.index("--device") + 2]
    text = policy.read_text()
    policy.write_text('device = "x86-laptop"\n' + text)
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 0 and "# m on x86-laptop" in proc.stdout, proc.stderr
    policy.write_text("probe_interval_s = -3\n" + text)  # the agent refuses it: so does this
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 2 and "probe_interval_s" in proc.stderr, proc.stderr


def test_a_replay_past_its_bounds_is_refused_before_it_runs(tmp_path):
    args = _inputs(tmp_path)
    workload = Path(args[args.index("--workload") + 1])
    for body, said in (
        ("count = 5\nrate_per_s = 1e-300\n", "30 days"),
        ("count = 1e30\n", "at most 1,000,000 requests"),
    ):
        workload.write_text(body)
        proc = _cli(*args, "--up", "steady:5", timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    workload.write_text("count = 20\nrate_per_s = 0.01\n")
    proc = _cli(*args, "--up", "steady:5", "--probe-interval-s", "1e-7", timeout=60)
    assert proc.returncode == 2 and "probes" in proc.stderr, proc.stderr
    workload.write_text("count = 20\nrate_per_s = 1.0\n")
    for spec in ("steady:1000000", "steady:46000"):  # any finite rate: it loops shorter
        proc = _cli(*args, "--up", spec, timeout=60)
        assert proc.returncode == 0, proc.stderr
    trace = tmp_path / "long.mm"
    trace.write_text("0\n1000000000\n")  # a legal 11.6-day trace: its downlink loops
    proc = _cli(*args, "--up", str(trace), "--link", "ethernet", timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_profile_with_strings_or_absurd_run_times_is_refused(tmp_path):
    args = _inputs(tmp_path)
    profile = Path(args[args.index("--profile") + 1])
    for doc, said in (
        ({"local_s": "5", "cloud_s": [0.01]}, "expected a list"),
        ({"local_s": [0.1], "cloud_s": [0.01], "local_cancellable": "false"}, "true or false"),
        ({"local_s": [1e308], "cloud_s": [1e308]}, "at most 3600 s"),
    ):
        profile.write_text(json.dumps(doc))
        proc = _cli(*args, "--up", "steady:5", timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_an_agent_toml_that_names_no_device_or_link_replays_what_the_agent_runs(tmp_path):
    args = _inputs(tmp_path)
    policy = Path(args[args.index("--policy") + 1])
    policy.write_text(f'repository = "{tmp_path}"\n' + policy.read_text())
    for flag in ("--device", "--link"):
        del args[args.index(flag) : args.index(flag) + 2]
    proc = _cli(*args, "--up", "steady:5")
    assert proc.returncode == 0, proc.stderr
    assert "# m on x86-laptop, wifi link" in proc.stdout  # the agent's own defaults


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("input_bytes = 1e300\n", "input_bytes"),  # int64 bytes had wrapped to negative costs
        ("input_bytes = 0.4\n", "input_bytes"),  # rounds to nothing sent
        ("input_bytes = [1000, 1e300]\n", "input_bytes"),
        ("output_bytes = 1e300\n", "output_bytes"),
    ],
)
def test_a_workload_past_what_a_replay_can_count_names_the_key(tmp_path, text, key):
    from edge.evaluation.workload import load_workload
    from shared.errors import ConfigError

    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"key '{key}': expected a number from"):
        load_workload(path)
