"""``ferry-edge profile``: measure compute profiles on real runtimes.

The replay evaluator draws local and cloud compute times from these
samples, so a policy is judged on the model's real latency distribution
(scaled by the device profile's speed factor for the local side) and on its
real top-1 confidences (for the cascade baseline).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from edge.core.scores import confidence
from edge.evaluation.sim import ComputeProfile
from shared.datatypes import numpy_dtype
from shared.errors import ConfigError
from shared.pipeline import PipelineSession, open_session, sample_inputs
from shared.repository import ModelRepository, complete_config
from shared.runtimes import RuntimeOptions
from shared.runtimes.base import cancellable


def _inputs(config, n: int, seed: int, session=None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    spec = config.inputs[0]
    if isinstance(session, PipelineSession):  # image inputs: encoded images, as apps send
        if len(config.inputs) == 1 and spec.datatype == "BYTES":
            from shared.modeltools.samples import orientation_jpegs

            pages, _ = orientation_jpegs(n, seed=seed, quality=70)
            return [{spec.name: np.array([[page]], dtype=object)} for page in pages]
        return [sample_inputs(session, config)] * n
    if len(config.inputs) == 1 and tuple(spec.dims) == (3, 224, 224):
        from shared.modeltools.samples import orientation_samples

        images, _ = orientation_samples(n, seed=seed)
        return [{spec.name: images[i : i + 1]} for i in range(n)]
    out = []
    for _ in range(n):
        feed = {}
        for s in config.inputs:
            shape = ([1] if config.max_batch_size else []) + list(s.sample_dims())
            feed[s.name] = rng.random(shape).astype(numpy_dtype(s.datatype))
        out.append(feed)
    return out


class Samples(NamedTuple):
    latencies: list[float]  # seconds per batch-1 run
    confidences: list[float]  # top-1 confidence of each answer (classifiers)
    cancellable: bool  # the runtime can stop a run halfway (races stop the local run)


def measure(repository: Path, model: str, runs: int, threads: int = 0, seed: int = 0) -> Samples:
    """Latency samples (s) and top-1 confidences of ``model`` on batch-1 inputs."""
    if runs < 1:
        raise ConfigError(f"--runs: expected at least 1 timed run, got {runs}")
    if threads < 0:
        raise ConfigError(f"--threads: expected 0 (the runtime's default) or more, got {threads}")
    repo = ModelRepository(repository)
    config = repo.read_config(model)
    version = repo.selected_versions(model, config)[-1]
    backend, path = repo.model_file(model, version, config.backend)
    session = open_session(backend, path, RuntimeOptions(threads=threads or None), config)
    config = complete_config(config, session)
    feeds = _inputs(config, min(runs, 64), seed, session)
    session.run(feeds[0])
    latencies, confidences = [], []
    for i in range(runs):
        feed = feeds[i % len(feeds)]
        t = time.perf_counter()
        out = session.run(feed)
        latencies.append(time.perf_counter() - t)
        scores = np.asarray(next(iter(out.values()))).reshape(-1)
        if scores.size > 1:
            confidences.append(confidence(scores))
    stoppable = cancellable(session)
    session.close()
    return Samples(latencies, confidences, stoppable)


def write_profile(
    path: Path, local: list[float], cloud: list[float], confidences: list[float], meta: dict
) -> None:
    path.write_text(
        json.dumps(
            {"local_s": local, "cloud_s": cloud, "confidences": confidences, **meta}, indent=1
        )
    )


#: The longest run a profile may hold (an hour: a replay's clock counts milliseconds).
MAX_RUN_S = 3600.0


def read_profile(path: Path, speed_factor: float = 1.0) -> ComputeProfile:
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict):
            raise TypeError(f"expected a JSON object, got {type(doc).__name__}")
        for key in ("local_s", "cloud_s", "confidences"):
            if not isinstance(doc.get(key, []), list):
                raise TypeError(f"key {key!r}: expected a list, got {type(doc[key]).__name__}")
        if not isinstance(doc.get("local_cancellable", False), bool):
            raise TypeError("key 'local_cancellable': expected true or false")
        for key in ("local_s", "cloud_s", "confidences"):
            if any(type(x) not in (int, float) for x in doc.get(key, [])):  # (true is 1.0)
                raise TypeError(f"key {key!r}: expected numbers")
        profile = ComputeProfile(
            local_s=tuple(float(x) for x in doc["local_s"]),
            cloud_s=tuple(float(x) for x in doc["cloud_s"]),
            confidences=tuple(float(x) for x in doc.get("confidences", ())),
            local_speed_factor=speed_factor,
            local_cancellable=bool(doc.get("local_cancellable", False)),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a compute profile ({exc})") from None
    for key in ("local_s", "cloud_s"):
        samples = getattr(profile, key)
        if not samples or not all(0 < x <= MAX_RUN_S for x in samples):  # also NaN
            raise ConfigError(
                f"{path}: key {key!r}: expected one or more run times > 0 s and at most "
                f"{MAX_RUN_S:.0f} s, "
                f"got {list(samples)[:5]}{' ...' if len(samples) > 5 else ''}"
            )
    if not all(0 <= c <= 1 for c in profile.confidences):
        raise ConfigError(f"{path}: key 'confidences': expected values from 0 to 1")
    return profile
