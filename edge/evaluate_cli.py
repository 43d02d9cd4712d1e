"""The ``ferry-edge evaluate`` and ``ferry-edge profile`` commands."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from devices.profiles import load_device, load_link
from edge.config import load_policy_file
from edge.evaluate import Workload, evaluate
from edge.evaluate_report import plots, table
from edge.profile import measure, read_profile, write_profile
from edge.traces import trace_from_spec
from shared.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_workload(path: Path | None) -> Workload:
    if path is None:
        return Workload()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read workload: {exc}") from None
    known = {f.name: f.type for f in fields(Workload)}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}; expected one of {sorted(known)}")
        if key == "arrival" and value not in ("poisson", "periodic"):
            raise ConfigError(
                f"{path}: key 'arrival': expected 'poisson' or 'periodic', got {value!r}"
            )
        if key != "arrival" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise ConfigError(f"{path}: key {key!r}: expected a non-negative number, got {value!r}")
    return Workload(**data)


def run_evaluate(args: argparse.Namespace) -> int:
    config = load_policy_file(args.policy)
    workload = load_workload(args.workload)
    if args.seed is not None:
        workload = replace(workload, seed=args.seed)
    device = load_device(args.device)
    if args.profile is None:
        raise ConfigError("--profile is required: measure one with 'ferry-edge profile'")
    profile = read_profile(args.profile, speed_factor=device.speed_factor)
    up = trace_from_spec(args.up)
    down = trace_from_spec(args.down) if args.down else up
    sim, results = evaluate(
        up=up,
        down=down,
        link=load_link(args.link),
        device=device,
        profile=profile,
        config=config,
        model=args.model,
        workload=workload,
        miss_penalty=args.miss_penalty,
    )
    title = f"{args.model} on {device.name}, {args.link} link, {up.name}"
    report = f"# {title}\n\n{workload.count} requests, seed {workload.seed}, deadline {workload.deadline_ms:.0f} ms\n\n"
    report += table(sim, results) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report)
        for png in plots(sim, results, args.out, title):
            print(f"wrote {png}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    local, confidences = measure(args.repository, args.local_model, args.runs, threads=args.threads)
    cloud, _ = measure(args.cloud_repository or args.repository, args.cloud_model, args.runs)
    write_profile(
        args.out,
        local,
        cloud,
        confidences,
        {"local_model": args.local_model, "cloud_model": args.cloud_model},
    )
    print(f"wrote {args.out}: {len(local)} local and {len(cloud)} cloud samples")
    return 0
