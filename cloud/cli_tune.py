"""``ferry-cloud tune``: measure models the way CPU-serving teams tune by hand
(backend, threads, batch size), write ``profiles.json`` for the placement
controller, a report per model, and optionally the chosen settings.

A model that cannot be read or run is reported and the others are still tuned
(one broken folder should not cost an hour of measurements); the exit status
is then 1.  Bad arguments are a ConfigError before anything is measured.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from shared.configcheck import writable_file, writable_folder
from shared.errors import ConfigError, FerryError


def add_tune_command(sub: Any) -> None:
    tune = sub.add_parser("tune", help="profile models: backends x threads x batch sizes")
    tune.add_argument("--repository", required=True, type=Path, help="model repository")
    tune.add_argument("--models", help="comma-separated models (default: all)")
    tune.add_argument("--latency-ms", type=float, default=100.0, help="latency objective (100)")
    tune.add_argument("--backends", help="comma-separated backends to try (default: all here)")
    tune.add_argument("--max-threads", type=int, help="largest intra-op thread count")
    tune.add_argument("--max-batch", type=int, help="largest batch size")
    tune.add_argument("--duration-s", type=float, default=1.0, help="time per point (1.0)")
    tune.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="INPUT:D1,D2,..",
        help="dims (without batch) for an input with dynamic dims; repeatable",
    )
    tune.add_argument("--out", required=True, type=Path, help="profiles.json to write")
    tune.add_argument("--report", type=Path, help="folder for tables and SVG plots")
    tune.add_argument("--apply", action="store_true", help="write the choices to config.toml")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shapes(values: list[str]) -> dict[str, tuple[int, ...]] | None:
    shapes = {}
    for value in values:
        name, _, dims = value.rpartition(":")
        try:
            parsed = tuple(int(d) for d in dims.split(","))
        except ValueError:
            parsed = ()
        if not name or not parsed or min(parsed) < 1:
            raise ConfigError(f"--shape {value!r}: expected INPUT:D1,D2,... with positive dims")
        shapes[name] = parsed
    return shapes or None


def _check(args: argparse.Namespace) -> list[str] | None:
    from shared.runtimes import BACKENDS

    if not (0 < args.latency_ms < math.inf and 0 < args.duration_s < math.inf):  # also NaN
        raise ConfigError("--latency-ms and --duration-s must be positive and finite")
    for flag in ("max_threads", "max_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if not args.backends:
        return None
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"--backends: unknown {unknown}; expected some of {sorted(BACKENDS)}")
    return backends


def run_tune_command(args: argparse.Namespace) -> int:
    from cloud.gpu import GpuMonitor
    from cloud.tuning.profiles import cpu_name, document, write_profiles
    from cloud.tuning.report import table, write_report
    from cloud.tuning.sweep import ModelResult, measure_model, plan_model
    from shared.repository import ModelRepository
    from shared.repository.capacity import available_memory
    from shared.runtimes.base import available_cpus

    backends = _check(args)
    shapes = _shapes(args.shape)
    writable_file(args.out, "--out")  # before the sweep, not after it
    if args.report:
        writable_folder(args.report, "--report")
    repository = ModelRepository(args.repository)
    names = repository.model_names()
    if args.models is not None:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        if not wanted:  # (an empty variable in a script: it had tuned every model)
            raise ConfigError(f"--models: no model named in {args.models!r}")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise ConfigError(
                f"--models: no such model in {args.repository}: {unknown}; it has {names}"
            )
        names = wanted
    gpu = GpuMonitor()
    has_gpu = gpu.start()
    samples = gpu.sample() if has_gpu else []
    gpu_name = ", ".join(sorted({s.name for s in samples})) if samples else None
    gpu_reason = gpu.reason
    gpu.close()
    cores = available_cpus()
    plans, failed = {}, {}
    try:
        for name in names:
            try:
                plans[name] = plan_model(
                    repository,
                    name,
                    cores=cores,
                    gpu=has_gpu,
                    gpu_reason=gpu_reason,
                    backends=backends,
                    max_threads=args.max_threads,
                )
            except FerryError as exc:
                failed[name] = exc.message
    except KeyboardInterrupt:
        print("ferry-cloud: interrupted before any model was measured", file=sys.stderr)
        return 130
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        total = sum(p.trials for p in plans.values())
        bar = tqdm(total=total, unit="trial", file=sys.stderr, leave=False, desc="tune")

    def progress(text: str, done: int) -> None:
        if bar is not None:
            bar.set_postfix_str(text[-50:], refresh=False)
            bar.update(done)

    results = []
    interrupted = False
    try:
        for name in names:
            if name in failed:
                results.append(ModelResult(name, error=failed[name]))
                continue
            results.append(
                measure_model(
                    repository,
                    plans[name],
                    duration_s=args.duration_s,
                    max_batch=args.max_batch,
                    shapes=shapes,
                    progress=progress,
                )
            )
    except KeyboardInterrupt:
        # Ctrl-C: the models measured so far are written (an hour's sweep was lost to a
        # traceback); the one under way is left out, and nothing is applied
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
    machine = {
        "cores": cores,
        "memory_bytes": available_memory(),
        "cpu": cpu_name(),
        "gpu": gpu_name,
    }
    doc = document(results, args.latency_ms, machine, args.duration_s)
    if interrupted:
        # --out may be the profiles a controller reads live: a sweep cut short does not
        # replace them; what it measured goes beside them
        measured = sum(1 for r in results if not r.error)
        partial = args.out.with_name(args.out.name + ".partial")
        if measured:
            write_profiles(partial, doc)
        print(
            f"ferry-cloud: interrupted: {measured} of {len(names)} models measured"
            + (f", written to {partial}" if measured else "")
            + f"; {args.out} left as it was"
            + ("; --apply skipped" if args.apply else ""),
            file=sys.stderr,
        )
        return 130
    write_profiles(args.out, doc)
    for name, entry in doc["models"].items():
        print(table(name, entry, args.latency_ms))
    if args.report:
        written = write_report(args.report, doc)
        print(f"report: {len(written)} files in {args.report}")
    print(f"profiles: {args.out}")
    measured = any(entry.get("trials") for entry in doc["models"].values())
    if not measured:  # (every backend asked for is missing here, say: not a success)
        print("ferry-cloud: nothing could be measured", file=sys.stderr)
    status = 1 if failed or any(r.error for r in results) or not measured else 0
    if args.apply:
        status = max(status, _apply(repository, doc, args.latency_ms, cores))
    return status


def _apply(repository: Any, doc: dict[str, Any], latency_ms: float, cores: int) -> int:
    from cloud.tuning.apply import apply_choice

    status = 0
    for name, entry in doc["models"].items():
        if entry.get("error"):
            continue
        if entry["chosen"] is None:
            why = "nothing meets the objective" if entry["trials"] else "nothing measured"
            print(f"not applied to {name}: {why}")
            continue
        try:
            path, warnings = apply_choice(repository, name, entry["chosen"], latency_ms, cores)
        except ConfigError as exc:
            print(f"ferry-cloud: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
            status = 1
            continue
        backup = path.with_suffix(".toml.bak")
        kept = f" (the original: {backup.name})" if backup.exists() else " (a new file)"
        print(f"applied to {path}{kept}")
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
    return status
