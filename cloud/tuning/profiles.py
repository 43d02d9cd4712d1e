"""``profiles.json``: what ``ferry-cloud tune`` measured, read by the controller and
``bench/packing.py``.  Schema (version 1), documented in docs/tuning.md::

    {"version": 1, "latency_objective_ms": 100,
     "machine": {"cores": 2, "memory_bytes": ..., "cpu": "...", "gpu": null},
     "models": {"<name>": {
        "chosen": {"backend", "threads", "batch", "throughput", "p99_ms"} | null,
        "profiles": [LatencyProfile.to_dict(), ...],   # one per backend: its best threads
        "trials": [{"backend", "threads", "memory_bytes", "a_s", "beta_s", "spread_s",
                    "points": [{"batch", "p50_ms", "p99_ms", "mean_ms", "runs",
                                "throughput"}]}],
        "skipped": {"<backend>": "why"}}}}
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from cloud.placement.types import LatencyProfile
from cloud.tuning.fit import choose
from cloud.tuning.sweep import ModelResult, Trial
from shared.errors import ConfigError

VERSION = 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_profiles(result: ModelResult) -> list[LatencyProfile]:
    """Per backend, the thread count with the most throughput at its largest batch."""
    best: dict[str, Trial] = {}
    for trial in result.trials:
        top = max(p.throughput for p in trial.points)
        held = best.get(trial.backend)
        if held is None or top > max(p.throughput for p in held.points):
            best[trial.backend] = trial
    return [
        LatencyProfile(
            backend=t.backend,
            a_s=t.fit.a_s,
            beta_s=max(t.fit.beta_s, 1e-9),
            max_batch=t.max_batch,
            # the first load of a backend also pays for the runtime's own code and arenas,
            # which later loads reuse: take the largest reading, not the luckiest
            memory_bytes=max(1, *(x.memory_bytes for x in result.trials if x.backend == t.backend)),
            threads=t.threads,
            spread_s=t.fit.spread_s,
        )
        for _, t in sorted(best.items())
    ]


def document(
    results: list[ModelResult], latency_ms: float, cores: int, memory: int, gpu: str | None
) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for result in results:
        chosen = choose(result.candidates(), latency_ms / 1000)
        models[result.name] = {
            "chosen": None
            if chosen is None
            else {
                "backend": chosen.backend,
                "threads": chosen.threads,
                "batch": chosen.point.batch,
                "throughput": round(chosen.point.throughput, 2),
                "p99_ms": round(chosen.point.p99_s * 1000, 3),
            },
            "profiles": [p.to_dict() for p in best_profiles(result)],
            "trials": [
                {
                    "backend": t.backend,
                    "threads": t.threads,
                    "memory_bytes": t.memory_bytes,
                    "a_s": t.fit.a_s,
                    "beta_s": t.fit.beta_s,
                    "spread_s": t.fit.spread_s,
                    "points": [
                        {
                            "batch": p.batch,
                            "p50_ms": round(p.p50_s * 1000, 4),
                            "p99_ms": round(p.p99_s * 1000, 4),
                            "mean_ms": round(p.mean_s * 1000, 4),
                            "runs": p.runs,
                            "throughput": round(p.throughput, 2),
                        }
                        for p in t.points
                    ],
                }
                for t in result.trials
            ],
            "skipped": dict(result.skipped),
        }
    return {
        "version": VERSION,
        "latency_objective_ms": latency_ms,
        "machine": {
            "cores": cores,
            "memory_bytes": memory,
            "cpu": _cpu_name(),
            "gpu": gpu,
        },
        "models": models,
    }


def write_profiles(path: Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def load_profiles(path: Path) -> dict[str, list[LatencyProfile]]:
    """Model name -> its latency profiles (one per backend); errors name the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ConfigError(f"{path}: key 'models': expected an object of models")
    if doc.get("version", VERSION) != VERSION:
        raise ConfigError(f"{path}: key 'version': expected {VERSION}, got {doc.get('version')!r}")
    out: dict[str, list[LatencyProfile]] = {}
    for name, entry in doc["models"].items():
        profiles = entry.get("profiles") if isinstance(entry, dict) else None
        if not isinstance(profiles, list):
            raise ConfigError(f"{path}: key 'models.{name}.profiles': expected a list")
        try:
            out[name] = [LatencyProfile.from_dict(p) for p in profiles]
        except ConfigError as exc:
            raise ConfigError(f"{path}: key 'models.{name}.profiles': {exc.message}") from None
    return out
