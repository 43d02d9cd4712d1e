"""The ``ferry-edge evaluate`` and ``ferry-edge profile`` commands."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from devices.profiles import load_device, load_link
from edge.config import agent_file_settings, load_policy_file, unreachable_transports
from edge.core.policy import TRANSPORTS, PolicyConfig
from edge.evaluation.evaluate import evaluate
from edge.evaluation.ours import PROBE_INTERVAL_S
from edge.evaluation.profile import measure, read_profile, write_profile
from edge.evaluation.report import plots, table
from edge.evaluation.workload import load_workload
from edge.netem.traces import Trace, steady, trace_from_spec
from shared.configcheck import writable_file, writable_folder
from shared.errors import ConfigError

__all__ = ["add_evaluate_arguments", "load_workload", "run_evaluate", "run_profile"]

DOWN_HELP = (
    "downlink trace; without it the downlink is steady at the link profile's down_mbps, for "
    "as long as the uplink trace (never the uplink trace reused; emulate-link without --down "
    "leaves the downlink unshaped)"
)


def add_evaluate_arguments(ev: argparse.ArgumentParser) -> None:
    """The options of ``ferry-edge evaluate`` (edge/cli.py builds the parser)."""
    ev.add_argument("--policy", type=Path, required=True, help="agent.toml or a policy-only TOML")
    ev.add_argument(
        "--device",
        help="device profile name or TOML (default: the agent.toml's device, which is the "
        "agent's own default where the file names none; raspberry-pi-4b for a policy-only file)",
    )
    ev.add_argument(
        "--link",
        help="link profile name or TOML (energy, RTT) of the one radio the replay has "
        "(default: the one the agent.toml's [links] names, which is the agent's own default "
        "where it names none; lte for a policy-only file)",
    )
    ev.add_argument(
        "--up",
        required=True,
        help="uplink trace (mahimahi or 't mbps'), or steady:MBPS, commute:SEED, markov:SEED, "
        "markov-off:SEED",
    )
    ev.add_argument("--down", help=DOWN_HELP)
    ev.add_argument("--model", required=True, help="model name as the policy file calls it")
    ev.add_argument(
        "--workload",
        type=Path,
        help="workload TOML (count, arrival, rate_per_s, input_bytes, output_bytes, "
        "deadline_ms, seed, battery_percent, data_used_mb); sizes and deadlines may be "
        "a list or {min, max}",
    )
    ev.add_argument(
        "--profile",
        type=Path,
        required=True,
        help="compute profile JSON (required: measure one with 'ferry-edge profile')",
    )
    ev.add_argument("--miss-penalty", type=float, default=1.0, help="cost of one missed deadline")
    ev.add_argument("--seed", type=int, help="override the workload's seed")
    ev.add_argument(
        "--transports",
        help="comma-separated transports the agent has endpoints for (default: the [cloud] "
        "section of an agent.toml, else every transport the model's policy lists)",
    )
    ev.add_argument(
        "--probe-interval-s",
        type=float,
        help=f"the agent's probe interval (default: the agent.toml's, else {PROBE_INTERVAL_S:g})",
    )
    ev.add_argument("--out", type=Path, help="folder for report.md and PNG plots")


def _link_name(
    given: str | None, named: dict[str, str], transports: tuple[str, ...] | None
) -> tuple[str, str]:
    """The link profile of the replay's one radio, and a note when the file says otherwise."""
    used = {t: n for t, n in named.items() if transports is None or t in transports}
    if given is not None:
        other = {t: n for t, n in used.items() if n != given}
        note = ""
        if other:
            listed = ", ".join(f"{t} = {n!r}" for t, n in sorted(other.items()))
            note = f"note: --link {given} replaces the file's [links] ({listed}): the replay has one radio\n\n"
        return given, note
    if not used:
        return "lte", ""
    names = sorted(set(used.values()))
    if len(names) > 1:
        listed = ", ".join(f"{t} = {n!r}" for t, n in sorted(used.items()))
        raise ConfigError(
            f"--link: the file's [links] name different profiles ({listed}) and the replay has "
            "one radio: pick one with --link"
        )
    return names[0], ""


def _transports(spec: str | None, from_file: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if spec is None:
        return from_file
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    for t in chosen:
        if t not in TRANSPORTS:
            raise ConfigError(f"--transports: unknown transport {t!r}; expected {list(TRANSPORTS)}")
    return chosen


def _policy_notes(
    config: PolicyConfig,
    model: str,
    transports: tuple[str, ...] | None,
    battery_percent: float | None = None,
) -> list[str]:
    """What the table's comparison leaves out: a model that can never offload, and
    limits only ours keeps (the oracle and the fixed rules are graded on the weighted
    cost alone)."""
    notes = unreachable_transports(config, transports, model)
    if config.data_cap_mb_per_day is not None:
        notes.append(
            f"ours keeps the data cap ({config.data_cap_mb_per_day:g} MB a day); the oracle "
            "and the fixed rules do not, so 'x oracle' also prices the cap"
        )
    if battery_percent is not None and battery_percent < config.battery_floor_percent:
        notes.append(
            f"the battery starts at {battery_percent:g}%, below the floor "
            f"({config.battery_floor_percent:g}%): ours weighs energy alone there, while the "
            "table grades every policy on the weighted cost"
        )
    return notes


def run_evaluate(args: argparse.Namespace) -> int:
    config = load_policy_file(args.policy)
    if config.models and args.model not in config.models:
        raise ConfigError(
            f"--model: {args.model!r} is not in {args.policy}'s [models] "
            f"({', '.join(sorted(config.models))})"
        )
    if not 0 <= args.miss_penalty < math.inf:  # also NaN
        raise ConfigError(f"--miss-penalty: expected a finite number >= 0, got {args.miss_penalty}")
    given = getattr(args, "probe_interval_s", None)
    if given is not None and not 0 < given < math.inf:
        raise ConfigError(f"--probe-interval-s: expected a number > 0, got {given}")
    workload = load_workload(args.workload)
    if args.seed is not None:
        if args.seed < 0:
            raise ConfigError(f"--seed: expected an integer >= 0, got {args.seed}")
        workload = replace(workload, seed=args.seed)
    settings = agent_file_settings(args.policy)
    device = load_device(args.device or settings.device or "raspberry-pi-4b")
    file_interval = settings.probe_interval_s
    transports = _transports(getattr(args, "transports", None), settings.transports)
    link_name, link_note = _link_name(args.link, settings.links, transports)
    link = load_link(link_name)
    notes = _policy_notes(config, args.model, transports, workload.battery_percent)
    link_note += "".join(f"note: {n}\n\n" for n in notes)
    if args.profile is None:
        raise ConfigError("--profile is required: measure one with 'ferry-edge profile'")
    profile = read_profile(args.profile, speed_factor=device.speed_factor)
    up = trace_from_spec(args.up)
    down: Trace
    if args.down:
        down = trace_from_spec(args.down)
        down_note = down.name
    else:
        name = f"steady:{link.down_mbps:g} (link profile {link.name!r}, no --down)"
        # over a minute at least: a steady trace's packets are whole per period, and a
        # period as short as a one-line uplink trace's would round the rate to nothing
        # (a steady trace loops like any other: a minute of it stands for any uplink)
        down = steady(link.down_mbps, 60.0, name=name)
        down_note = name
    if args.out:
        writable_folder(args.out, "--out")  # before the replay, not after it
    interval = (
        given
        if given is not None
        else (file_interval if file_interval is not None else PROBE_INTERVAL_S)
    )
    ev = evaluate(
        up=up,
        down=down,
        link=link,
        device=device,
        profile=profile,
        config=config,
        model=args.model,
        workload=workload,
        miss_penalty=args.miss_penalty,
        transports=transports,
        probe_interval_s=interval,
    )
    title = f"{args.model} on {device.name}, {link.name} link, {up.name}"
    report = (
        f"# {title}\n\n{workload.count} requests, seed {workload.seed}; "
        f"uplink {up.name} ({up.mean_mbps():.2f} Mbps mean), downlink {down_note} "
        f"({down.mean_mbps():.2f} Mbps mean); static choice: {ev.static_choice}\n\n{link_note}"
    )
    report += table(ev.sim, ev.results) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report)
        for png in plots(ev.sim, ev.results, args.out, title):
            print(f"wrote {png}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    writable_file(args.out, "--out")  # before the runs, not after them
    local = measure(args.repository, args.local_model, args.runs, threads=args.threads)
    cloud = measure(args.cloud_repository or args.repository, args.cloud_model, args.runs)
    write_profile(
        args.out,
        local.latencies,
        cloud.latencies,
        local.confidences,
        {
            "local_model": args.local_model,
            "cloud_model": args.cloud_model,
            # whether a race's local run can be stopped when the cloud answers first
            "local_cancellable": local.cancellable,
        },
    )
    print(
        f"wrote {args.out}: {len(local.latencies)} local and {len(cloud.latencies)} cloud samples"
    )
    return 0
