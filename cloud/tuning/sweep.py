"""The measurement loop of ``ferry-cloud tune`` (blocking: it runs the runtimes).

For one model: every backend whose model file is in the newest version folder
and whose runtime is installed (TensorRT only with a GPU), intra-op threads
1, 2, 4 ... up to the cores (and the cores themselves), batch sizes 1, 2, 4 ...
up to ``max_batch_size``.  Each point runs for ``duration_s`` (at least
``min_runs`` times) on random inputs after a warm-up run; resident memory is
the growth of the process while the session loads and warms.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from cloud.loading import MemoryProbe
from cloud.tuning.fit import Candidate, Fit, Point, fit_linear
from shared.datatypes import numpy_dtype
from shared.repository import ModelConfig, ModelRepository, complete_config
from shared.runtimes import MODEL_FILES, installed_backends, load_session


@dataclass
class Trial:
    """One backend with one thread count: its points, fit and memory."""

    backend: str
    threads: int
    points: list[Point]
    fit: Fit
    memory_bytes: int
    max_batch: int


@dataclass
class ModelResult:
    name: str
    trials: list[Trial] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why

    def candidates(self) -> list[Candidate]:
        return [Candidate(t.backend, t.threads, p) for t in self.trials for p in t.points]


def thread_counts(cores: int, limit: int | None = None) -> list[int]:
    top = min(cores, limit or cores)
    counts = {top}
    n = 1
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def batch_sizes(max_batch: int, limit: int | None = None) -> list[int]:
    if max_batch <= 0:
        return [1]
    top = min(max_batch, limit or max_batch)
    sizes, n = [], 1
    while n < top:
        sizes.append(n)
        n *= 2
    return [*sizes, top]


def random_inputs(
    config: ModelConfig, batch: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Random inputs of ``batch`` items (dynamic dims as 1), or ValueError for BYTES."""
    lead = [batch] if config.max_batch_size else []
    out = {}
    for spec in config.inputs:
        if spec.datatype == "BYTES":
            raise ValueError(f"input {spec.name!r} is BYTES: no meaningful random data")
        shape = tuple(lead + [d if d > 0 else 1 for d in spec.dims])
        dtype = numpy_dtype(spec.datatype)
        if dtype.kind == "f" or dtype.name == "bfloat16":
            arr = rng.random(shape, dtype=np.float32).astype(dtype)
        elif dtype.kind == "b":
            arr = rng.random(shape) < 0.5
        else:
            arr = rng.integers(0, 2, shape).astype(dtype)
        out[spec.name] = arr
    return out


def candidate_backends(
    repository: ModelRepository, name: str, gpu: bool
) -> tuple[list[str], dict[str, str]]:
    config = repository.read_config(name)
    versions = repository.selected_versions(name, config)
    folder = repository.model_dir(name) / str(versions[-1])
    present = [b for f, b in MODEL_FILES.items() if (folder / f).is_file()]
    if config.backend:
        present = [b for b in present if b == config.backend]
    installed = set(installed_backends())
    usable, skipped = [], {}
    for backend in present:
        if backend not in installed:
            skipped[backend] = "runtime not installed"
        elif backend == "tensorrt" and not gpu:
            skipped[backend] = "no GPU on this machine"
        else:
            usable.append(backend)
    return usable, skipped


def measure_model(
    repository: ModelRepository,
    name: str,
    *,
    cores: int,
    gpu: bool = False,
    backends: list[str] | None = None,
    max_threads: int | None = None,
    max_batch: int | None = None,
    duration_s: float = 1.0,
    min_runs: int = 5,
    progress: Callable[[str], None] = lambda _: None,
) -> ModelResult:
    result = ModelResult(name)
    usable, result.skipped = candidate_backends(repository, name, gpu)
    if backends:
        for b in usable:
            if b not in backends:
                result.skipped[b] = "not asked for (--backends)"
        usable = [b for b in usable if b in backends]
    base = repository.read_config(name)
    version = repository.selected_versions(name, base)[-1]
    rng = np.random.default_rng(0)
    probe = MemoryProbe()
    for backend in usable:
        _, path = repository.model_file(name, version, backend)
        for threads in thread_counts(cores, max_threads):
            gc.collect()
            before = probe.read()
            options = replace(base.runtime.to_options(), threads=threads)
            session = load_session(backend, path, options)
            try:
                config = complete_config(replace(base, backend=backend), session)
                try:
                    session.run(random_inputs(config, 1, rng))  # warm-up
                except ValueError as exc:
                    result.skipped[backend] = str(exc)
                    break
                memory = MemoryProbe.growth(before, probe.read())
                points = []
                for batch in batch_sizes(config.max_batch_size or 0, max_batch):
                    progress(f"{name} {backend} threads={threads} batch={batch}")
                    points.append(
                        _time(
                            session, random_inputs(config, batch, rng), batch, duration_s, min_runs
                        )
                    )
            finally:
                session.close()
            result.trials.append(
                Trial(
                    backend,
                    threads,
                    points,
                    fit_linear(points),
                    memory,
                    max(1, config.max_batch_size or 1),
                )
            )
    return result


def _time(
    session, inputs: dict[str, np.ndarray], batch: int, duration_s: float, min_runs: int
) -> Point:
    session.run(inputs)  # first run at this shape
    times = []
    until = time.perf_counter() + duration_s
    while len(times) < min_runs or time.perf_counter() < until:
        start = time.perf_counter()
        session.run(inputs)
        times.append(time.perf_counter() - start)
        if len(times) >= 10_000:
            break
    arr = np.array(times)
    return Point(
        batch=batch,
        p50_s=float(np.percentile(arr, 50)),
        p99_s=float(np.percentile(arr, 99)),
        mean_s=float(arr.mean()),
        runs=len(times),
    )
