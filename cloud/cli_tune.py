"""``ferry-cloud tune``: measure models the way CPU-serving teams tune by hand
(backend, threads, batch size), write ``profiles.json`` for the placement
controller, a report per model, and optionally the chosen settings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shared.errors import ConfigError


def add_tune_command(sub: Any) -> None:
    tune = sub.add_parser("tune", help="profile models: backends x threads x batch sizes")
    tune.add_argument("--repository", required=True, type=Path, help="model repository")
    tune.add_argument("--models", help="comma-separated models (default: all)")
    tune.add_argument("--latency-ms", type=float, default=100.0, help="latency objective (100)")
    tune.add_argument("--backends", help="comma-separated backends to try (default: all here)")
    tune.add_argument("--max-threads", type=int, help="largest intra-op thread count")
    tune.add_argument("--max-batch", type=int, help="largest batch size")
    tune.add_argument("--duration-s", type=float, default=1.0, help="time per point (1.0)")
    tune.add_argument("--out", required=True, type=Path, help="profiles.json to write")
    tune.add_argument("--report", type=Path, help="folder for tables and SVG plots")
    tune.add_argument("--apply", action="store_true", help="write the choices to config.toml")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_tune_command(args: argparse.Namespace) -> int:
    from cloud.gpu import GpuMonitor
    from cloud.tuning.apply import apply_choice
    from cloud.tuning.profiles import document, write_profiles
    from cloud.tuning.report import table, write_report
    from cloud.tuning.sweep import measure_model
    from shared.repository import ModelRepository
    from shared.repository.capacity import available_memory
    from shared.runtimes.base import available_cpus

    if args.latency_ms <= 0 or args.duration_s <= 0:
        raise ConfigError("--latency-ms and --duration-s must be positive")
    repository = ModelRepository(args.repository)
    names = repository.model_names()
    if args.models:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise ConfigError(f"--models: no such model in {args.repository}: {unknown}")
        names = wanted
    gpu = GpuMonitor()
    has_gpu = gpu.start()
    cores = available_cpus()
    backends = args.backends.split(",") if args.backends else None
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names), unit="model", file=sys.stderr, leave=False)
    results = []
    try:
        for name in names:

            def progress(text: str) -> None:
                if bar is not None:
                    bar.set_postfix_str(text[-60:])

            results.append(
                measure_model(
                    repository,
                    name,
                    cores=cores,
                    gpu=has_gpu,
                    backends=backends,
                    max_threads=args.max_threads,
                    max_batch=args.max_batch,
                    duration_s=args.duration_s,
                    progress=progress,
                )
            )
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        gpu.close()
    doc = document(
        results, args.latency_ms, cores, available_memory(), gpu.reason if has_gpu else None
    )
    write_profiles(args.out, doc)
    for name, entry in doc["models"].items():
        print(table(name, entry, args.latency_ms))
    if args.report:
        written = write_report(args.report, doc)
        print(f"report: {len(written)} files in {args.report}")
    print(f"profiles: {args.out}")
    if args.apply:
        for name, entry in doc["models"].items():
            if entry["chosen"] is None:
                print(f"not applied to {name}: nothing meets the objective")
                continue
            path = apply_choice(repository.model_dir(name), name, entry["chosen"])
            print(f"applied to {path}")
    return 0
