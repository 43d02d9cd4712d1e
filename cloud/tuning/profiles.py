"""``profiles.json``: what ``ferry-cloud tune`` measured, read by the controller and
``bench/packing.py``.  Schema (version 1, documented with an example in
docs/tuning.md)::

    {"version": 1, "created": "...", "latency_objective_ms": 100, "duration_s": 1.0,
     "machine": {"cores": 2, "memory_bytes": ..., "cpu": "...", "gpu": null},
     "models": {"<name>": {
        "version": 1, "max_batch_size": 32, "sessions": 2,
        "chosen": {"backend", "threads", "batch", "throughput", "p99_ms",
                   "max_queue_delay_us"} | null,
        "converted_best": {... as chosen, backend not served by the files} | absent,
        "profiles": [LatencyProfile.to_dict(), ...],  # per backend, at its best threads
        "trials": [{"backend", "threads", "converted", "memory_bytes", "a_s", "beta_s",
                    "spread_s", "fit_batches": [...],
                    "points": [{"batch", "p50_ms", "p99_ms", "mean_ms", "runs",
                                "throughput"}]}],
        "skipped": {"<backend>": "why"}, "notes": [...], "error": "why" | absent}}}

A trial's ``memory_bytes`` is one session; a profile's is one loaded copy (the
model's instance count times its served versions), the figure a node reports.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from cloud.placement.types import LatencyProfile
from cloud.tuning.fit import Candidate, choose, queue_delay_us
from cloud.tuning.sweep import ModelResult, Trial
from shared.errors import ConfigError

VERSION = 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_profiles(result: ModelResult, latency_s: float) -> list[LatencyProfile]:
    """Per backend, the thread count of its best point under the objective (else of
    its most throughput; the overall choice's own for its backend): the placement
    sizes copies with that configuration."""
    chosen = choose(result.candidates(), latency_s)
    out = []
    for backend in sorted({t.backend for t in result.trials}):
        trials = [t for t in result.trials if t.backend == backend]
        candidates = [Candidate(t.backend, t.threads, p) for t in trials for p in t.points]
        best = choose(candidates, latency_s) or max(candidates, key=lambda c: c.point.throughput)
        if chosen is not None and chosen.backend == backend:
            best = chosen
        trial = next(t for t in trials if t.threads == best.threads)
        fit, _ = trial.fit(latency_s)
        out.append(
            LatencyProfile(
                backend=backend,
                a_s=fit.a_s,
                beta_s=max(fit.beta_s, 1e-9),
                max_batch=trial.max_batch,
                memory_bytes=max(1, trial.memory_bytes * result.sessions),
                threads=trial.threads,
                spread_s=fit.spread_s,
            )
        )
    return out


def _choice(best: Candidate | None, latency_s: float) -> dict[str, Any] | None:
    if best is None:
        return None
    return {
        "backend": best.backend,
        "threads": best.threads,
        "batch": best.point.batch,
        "throughput": round(best.point.throughput, 2),
        "p99_ms": round(best.point.p99_s * 1000, 3),
        # what --apply writes: batch 1 is best, so waiting to batch only costs latency
        "max_queue_delay_us": (
            queue_delay_us(latency_s, best.point.p99_s, None) if best.point.batch > 1 else 0
        ),
    }


def model_entry(result: ModelResult, latency_ms: float) -> dict[str, Any]:
    latency_s = latency_ms / 1000
    chosen = choose(result.candidates(), latency_s)
    entry: dict[str, Any] = {
        "version": result.version,
        "max_batch_size": result.max_batch_size,
        "sessions": result.sessions,
        "chosen": _choice(chosen, latency_s),
    }
    anywhere = choose(result.candidates(converted=True), latency_s)
    if anywhere is not None and anywhere.backend not in result.servable:
        if chosen is None or anywhere.point.throughput > chosen.point.throughput * 1.02:
            entry["converted_best"] = _choice(anywhere, latency_s)
    entry["profiles"] = [p.to_dict() for p in best_profiles(result, latency_s)]
    entry["trials"] = [_trial(t, latency_s) for t in result.trials]
    entry["skipped"] = dict(result.skipped)
    entry["notes"] = list(result.notes)
    if result.error is not None:
        entry["error"] = result.error
    return entry


def _trial(t: Trial, latency_s: float) -> dict[str, Any]:
    fit, batches = t.fit(latency_s)
    return {
        "backend": t.backend,
        "threads": t.threads,
        "converted": t.converted,
        "memory_bytes": t.memory_bytes,
        "a_s": fit.a_s,
        "beta_s": fit.beta_s,
        "spread_s": fit.spread_s,
        "fit_batches": batches,
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


def document(
    results: list[ModelResult],
    latency_ms: float,
    machine: dict[str, Any],
    duration_s: float = 0.0,
) -> dict[str, Any]:
    """The whole file; ``machine`` holds cores, memory_bytes, cpu and gpu (or None)."""
    return {
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "latency_objective_ms": latency_ms,
        "duration_s": duration_s,
        "machine": machine,
        "models": {r.name: model_entry(r, latency_ms) for r in results},
    }


def write_profiles(path: Path, doc: dict[str, Any]) -> None:
    """Atomically: a controller reading the file mid-write must see the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # no stray half of an atomic write
        raise


def read_document(path: Path) -> dict[str, Any]:
    """The parsed file, its envelope checked; errors name the file and the key."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("version", VERSION) != VERSION:
        raise ConfigError(f"{path}: key 'version': expected {VERSION}, got {doc.get('version')!r}")
    if not isinstance(doc.get("models"), dict):
        raise ConfigError(f"{path}: key 'models': expected an object of models")
    for name, entry in doc["models"].items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: key 'models.{name}': expected an object")
    return doc


def _profiles(path: Path, name: str, entry: dict[str, Any]) -> list[LatencyProfile]:
    listed = entry.get("profiles", [])
    if not isinstance(listed, list):
        raise ConfigError(f"{path}: key 'models.{name}.profiles': expected a list")
    out = []
    for i, item in enumerate(listed):
        if not isinstance(item, dict):
            raise ConfigError(f"{path}: key 'models.{name}.profiles[{i}]': expected an object")
        try:
            out.append(LatencyProfile.from_dict(item))
        except ConfigError as exc:
            raise ConfigError(f"{path}: key 'models.{name}.profiles[{i}]': {exc.message}") from None
    chosen = entry.get("chosen")
    if chosen is not None and not isinstance(chosen, dict):
        raise ConfigError(f"{path}: key 'models.{name}.chosen': expected an object or null")
    backend = (chosen or {}).get("backend")
    out.sort(key=lambda p: p.backend != backend)  # stable: the chosen backend first
    return out


def load_profiles(path: Path) -> dict[str, list[LatencyProfile]]:
    """Model name -> its latency profiles, one per backend, the chosen backend's first
    (models with none are left out: the controller then plans from what nodes report)."""
    doc = read_document(path)
    out = {}
    for name, entry in doc["models"].items():
        profiles = _profiles(path, name, entry)
        if profiles:
            out[name] = profiles
    return out


def chosen_profile(path: Path, model: str) -> LatencyProfile | None:
    """The profile of ``model``'s chosen configuration; None when nothing met the
    objective or the model was not tuned.  A chosen backend without a profile is a
    broken file, not a missing measurement, so it raises."""
    doc = read_document(path)
    entry = doc["models"].get(model)
    if entry is None or not entry.get("chosen"):
        return None
    profiles = _profiles(path, model, entry)
    if not profiles or profiles[0].backend != entry["chosen"].get("backend"):
        raise ConfigError(
            f"{path}: key 'models.{model}.profiles': no profile for the chosen backend "
            f"{entry['chosen'].get('backend')!r}"
        )
    return profiles[0]
