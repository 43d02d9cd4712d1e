"""The measurement loop of ``ferry-cloud tune`` (blocking: it runs the runtimes).

:func:`plan_model` decides what to try for one model, cheaply and before any
session loads (so a progress bar knows its length): every backend whose file is
in the newest served version folder and whose runtime is installed (TensorRT
only with a GPU), and OpenVINO on the ONNX file itself when the folder holds no
IR (OpenVINO reads ONNX, and a node serves it so).  :func:`measure_model` then runs it: per backend,
intra-op threads 1, 2, 4 ... up to the cores (and the cores themselves); per
thread count, batch sizes 1, 2, 4 ... up to ``max_batch_size``.  Each point runs
for ``duration_s`` (at least ``min_runs`` times) on random inputs.

Memory is measured the way the dataplane measures a load (``MemoryProbe``: the
growth of the process), after a first throw-away load of the backend so the
runtime's one-time start-up is not billed to every model, and read again after
the largest batch so activation buffers count.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cloud.loading import MemoryProbe
from cloud.tuning.fit import Candidate, Fit, Point, fit_within
from shared.datatypes import bf16_dtype, numpy_dtype
from shared.errors import FerryError
from shared.pipeline import PipelineSession, open_session, sample_inputs
from shared.repository import ModelConfig, ModelRepository, complete_config
from shared.runtimes import ALSO_READS, MODEL_FILES, Session, installed_backends

#: (what runs now, trials finished since the last call) -> None
Progress = Callable[[str, int], None]


@dataclass(frozen=True)
class Target:
    """One backend to try; ``converted``: ``path`` is an ONNX file to convert first."""

    backend: str
    path: Path
    threads: tuple[int, ...]
    converted: bool = False


@dataclass
class Plan:
    name: str
    version: int
    config: ModelConfig
    targets: list[Target] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why
    servable: frozenset[str] = frozenset()  # backends the folder's files serve as they are

    @property
    def trials(self) -> int:
        return sum(len(t.threads) for t in self.targets)


@dataclass
class Trial:
    """One backend with one thread count: its points and memory per session."""

    backend: str
    threads: int
    points: list[Point]
    memory_bytes: int
    max_batch: int
    converted: bool = False

    def fit(self, latency_s: float) -> tuple[Fit, list[int]]:
        """``l(b)`` over the batch sizes within the objective, and those sizes."""
        return fit_within(self.points, latency_s)


class Untunable(ValueError):
    """The model runs, but not on inputs tuning can make up (not a failure to read it)."""


class Unlike(ValueError):
    """A backend runs the model, but does not answer what the model's own backend does."""


#: how far a float answer may stray from the model's own backend's, relative to the
#: output's largest magnitude, and still be the same model: OpenVINO rounds every
#: activation to bf16 on a CPU that has it (the example CNN's answers moved 2.6%,
#: its int8 variant's 8%), which a user may well take for the speed; a wrong
#: conversion, a clamped range or a wrapped value is far beyond it
ANSWER_RTOL = 0.25
#: a deviation past this is said in the model's notes (how far, for the operator to judge)
NOTE_RTOL = 1e-3


def _differs(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> tuple[str | None, float]:
    """(why ``got`` is not the answer ``want`` is, or None; the largest float
    deviation, relative to its output's largest magnitude)."""
    worst = 0.0
    for name, ref in want.items():
        out = got.get(name)
        if out is None:
            return f"no output {name!r}", worst
        if out.shape != ref.shape:
            return f"output {name!r} has shape {list(out.shape)}, not {list(ref.shape)}", worst
        if ref.dtype.kind not in "fc" and ref.dtype != bf16_dtype():  # (exact kinds)
            if not np.array_equal(out, ref):
                bad = int(np.count_nonzero(out != ref))
                return f"{bad} of {ref.size} values of output {name!r} differ", worst
            continue
        a, b = ref.astype(np.float64), out.astype(np.float64)
        if not np.array_equal(np.isnan(a), np.isnan(b)) or not np.array_equal(
            np.isinf(a), np.isinf(b)
        ):
            return f"output {name!r} has NaN or infinities where the other has not", worst
        finite = np.isfinite(a)
        if finite.any():
            scale = float(np.abs(a[finite]).max())
            diff = float(np.abs(a[finite] - b[finite]).max())
            worst = max(worst, diff / scale if scale > 0 else (diff and 1.0))
            if diff > ANSWER_RTOL * scale + 1e-6:
                why = f"output {name!r} differs by up to {diff:.3g} (its values reach {scale:.3g})"
                return why, worst
    return None, worst


@dataclass
class ModelResult:
    name: str
    version: int = 0
    max_batch_size: int = 0
    sessions: int = 1  # sessions per loaded copy: instance count x served versions
    servable: frozenset[str] = frozenset()
    trials: list[Trial] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # the model could not be tuned at all

    def candidates(self, converted: bool = False) -> list[Candidate]:
        """Every measured point; converted backends only when asked (the repository
        cannot serve them until the IR is written into the version folder)."""
        return [
            Candidate(t.backend, t.threads, p)
            for t in self.trials
            if converted or not t.converted
            for p in t.points
        ]


def thread_counts(cores: int, limit: int | None = None) -> list[int]:
    top = max(1, min(cores, limit or cores))
    counts, n = {top}, 1
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def batch_sizes(max_batch: int, limit: int | None = None) -> list[int]:
    if max_batch <= 0:
        return [1]
    top = max(1, min(max_batch, limit or max_batch))
    sizes, n = [], 1
    while n < top:
        sizes.append(n)
        n *= 2
    return [*sizes, top]


def random_inputs(
    config: ModelConfig,
    batch: int,
    rng: np.random.Generator,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, np.ndarray]:
    """Random inputs of ``batch`` items for a completed config; dynamic dims come from
    ``shapes`` or are 1.  Integers are 0 or 1 (valid ids for any embedding table).
    ValueError for BYTES: random bytes mean nothing to a model that parses them."""
    lead = [batch] if config.max_batch_size else []
    out = {}
    for spec in config.inputs:
        if spec.datatype == "BYTES":
            raise Untunable(f"input {spec.name!r} is BYTES: random bytes cannot exercise it")
        dims = (shapes or {}).get(spec.name) or spec.sample_dims()
        shape = tuple(lead + list(dims))
        dtype = numpy_dtype(spec.datatype)
        if dtype.kind == "b":
            arr = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            arr = rng.integers(0, 2, shape).astype(dtype)
        else:  # float kinds and ml_dtypes' bfloat16
            arr = rng.random(shape, dtype=np.float32).astype(dtype)
        out[spec.name] = arr
    return out


def plan_model(
    repository: ModelRepository,
    name: str,
    *,
    cores: int,
    gpu: bool = False,
    gpu_reason: str = "no GPU on this machine",
    backends: list[str] | None = None,
    max_threads: int | None = None,
) -> Plan:
    """What to measure for ``name``.  The config's own ``backend`` does not limit it
    (choosing the backend is tuning's job); ``[placement] backends`` and
    ``--backends`` do.  Raises FerryError for a model that cannot be read."""
    config = repository.read_config(name)
    versions = repository.selected_versions(name, config)
    if not versions:
        raise FerryError(f"model {name!r}: no served version holds a model file")
    folder = repository.model_dir(name) / str(versions[-1])
    files = {b: folder / f for f, b in MODEL_FILES.items() if (folder / f).is_file()}
    for found, path in list(files.items()):
        for also in ALSO_READS.get(found, ()):
            # OpenVINO reads the ONNX file, and serves it so: measured (and chosen) as is
            files.setdefault(also, path)
    plan = Plan(name, versions[-1], config, servable=frozenset(files))
    installed = set(installed_backends())
    candidates: dict[str, Path | None] = dict(files)
    if gpu:  # a GPU node's operator expects TensorRT in the table, tried or said why not
        candidates.setdefault("tensorrt", None)
    for backend, path in candidates.items():
        allowed = config.placement.backends
        if backends and backend not in backends:
            plan.skipped[backend] = "not asked for (--backends)"
        elif allowed and backend not in allowed:
            plan.skipped[backend] = f"not in [placement] backends {list(allowed)}"
        elif backend not in installed:
            plan.skipped[backend] = "runtime not installed"
        elif backend == "tensorrt" and not gpu:
            plan.skipped[backend] = gpu_reason
        elif path is None:
            plan.skipped[backend] = (
                f"no model.plan in version {versions[-1]}: an engine serves one GPU model and "
                "TensorRT version, so build it on this node "
                "(trtexec --onnx=model.onnx --saveEngine=model.plan)"
            )
        else:
            threads = (1,) if backend == "tensorrt" else tuple(thread_counts(cores, max_threads))
            converted = backend not in plan.servable
            plan.targets.append(Target(backend, path, threads, converted))
    return plan


def measure_model(
    repository: ModelRepository,
    plan: Plan,
    *,
    duration_s: float = 1.0,
    min_runs: int = 5,
    max_batch: int | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    progress: Progress = lambda _text, _done: None,
) -> ModelResult:
    """Run ``plan``.  A backend that fails to convert, load or run is recorded in
    ``skipped`` with the runtime's reason, and the other backends still run."""
    base = plan.config
    result = ModelResult(plan.name, plan.version, servable=plan.servable)
    result.skipped = dict(plan.skipped)
    result.sessions = base.instance_group.count * len(repository.selected_versions(plan.name, base))
    sweep = _Sweep(base, duration_s, min_runs, max_batch, shapes, progress)
    untunable = False
    # The config's own backend answers first: another may take its place only if it
    # answers the same (see _differs), and computes every port at its datatype.
    own = base.backend
    if own is None:  # the one the folder's files give a node (onnx, xml, tflite, plan)
        try:
            own = repository.model_file(plan.name, plan.version)[0]
        except FerryError:
            own = None
    reference: tuple[str, dict[str, np.ndarray]] | None = None
    for target in sorted(plan.targets, key=lambda t: t.backend != own):
        done = 0
        with tempfile.TemporaryDirectory(prefix="ferry-tune-") as tmp:
            try:
                path = _model_path(target, Path(tmp))
                config, answer, narrowed = sweep.prime(target.backend, path)
                # FP64 computed as FP32 loses every value's precision; INT64 computed as
                # INT32 is refused past INT32's range at each request (ids and indices,
                # BERT's input_ids, are well inside it: the answer check sees the rest)
                lossy = {n: how for n, how in narrowed.items() if how.startswith("FP64")}
                if target.backend != own and lossy:
                    ports = ", ".join(f"{n} {how}" for n, how in sorted(lossy.items()))
                    raise Unlike(f"it computes {ports}; the model's own backend ({own}) does not")
                if reference is None:
                    reference = (target.backend, answer)
                else:
                    why, worst = _differs(reference[1], answer)
                    if why is not None:
                        raise Unlike(
                            f"its answers differ from {reference[0]}'s on one input: {why}"
                        )
                    if worst > NOTE_RTOL:
                        note = (
                            f"{target.backend}'s answers differ from {reference[0]}'s by up to "
                            f"{worst:.1%} of an output's largest value on one input (its "
                            "arithmetic: OpenVINO computes in bf16 on CPUs that have it "
                            'unless [runtime] precision_hint = "f32")'
                        )
                        result.notes = sorted({*result.notes, note})
                result.max_batch_size = config.max_batch_size or 0
                if shapes is None and any(not s.ranked or -1 in s.dims for s in config.inputs):
                    note = "dynamic input dims measured as 1 (--shape gives real ones)"
                    result.notes = sorted({*result.notes, note})
                unused = sorted(set(shapes or ()) - {s.name for s in config.inputs})
                if unused:  # a typo must not pass for a measured shape
                    names = sorted(s.name for s in config.inputs)
                    note = f"--shape {unused} names no input of this model (its inputs: {names})"
                    result.notes = sorted({*result.notes, note})
                for threads in target.threads:
                    progress(f"{plan.name} {target.backend} {threads}t", 0)
                    result.trials.append(sweep.trial(target, path, config, threads))
                    done += 1
                    progress(f"{plan.name} {target.backend} {threads}t", 1)
            except (FerryError, ValueError, RuntimeError, MemoryError, OSError) as exc:
                # one backend's failure is a finding about the model, not the end of the run
                why = exc.message if isinstance(exc, FerryError) else str(exc)
                result.skipped[target.backend] = why or type(exc).__name__
                progress(f"{plan.name} {target.backend} skipped", len(target.threads) - done)
                untunable = untunable or isinstance(exc, Untunable)
    if plan.targets and not result.trials and not untunable:  # every runtime failed it
        tried = "; ".join(f"{t.backend}: {result.skipped.get(t.backend)}" for t in plan.targets)
        result.error = f"no runtime could load and run it ({tried})"
    return result


@dataclass
class _Sweep:
    """The settings one model's sweep shares across backends and thread counts."""

    base: ModelConfig
    duration_s: float
    min_runs: int
    max_batch: int | None
    shapes: dict[str, tuple[int, ...]] | None
    progress: Progress
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    probe: MemoryProbe = field(default_factory=MemoryProbe)

    def inputs(
        self, config: ModelConfig, batch: int, session: Session | None = None
    ) -> dict[str, np.ndarray]:
        """Random tensors; for a model with image inputs, photo-like images (the
        pipeline's decode is part of what a served request costs)."""
        if isinstance(session, PipelineSession):
            return sample_inputs(session, config, batch)
        return random_inputs(config, batch, self.rng, self.shapes)

    def prime(
        self, backend: str, path: Path
    ) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, str]]:
        """Load, check and run once, then close: pays the runtime's one-time start-up
        (imports, plugins, thread pools) before memory is measured, and finds a model
        this backend cannot run before the sweep starts.  Returns the completed config,
        the answer to one input every backend is asked (the same for each), and the
        ports this runtime computes narrower than their datatypes."""
        options = replace(self.base.runtime.to_options(self.base.instance_group.kind), threads=1)
        session = open_session(backend, path, options, self.base)
        try:
            config = complete_config(replace(self.base, backend=backend), session)
            session.run(self.inputs(config, 1, session))
            if isinstance(session, PipelineSession):
                check = sample_inputs(session, config, 1)  # (the same images each time)
            else:
                check = random_inputs(config, 1, np.random.default_rng(7), self.shapes)
            answer = session.run(check)
            narrowed = dict(getattr(session, "narrowed", None) or {})
            return config, answer, narrowed
        finally:
            session.close()

    def trial(self, target: Target, path: Path, config: ModelConfig, threads: int) -> Trial:
        options = self.base.runtime.to_options(self.base.instance_group.kind)
        gc.collect()
        before = self.probe.read()
        session = open_session(target.backend, path, replace(options, threads=threads), self.base)
        try:
            session.run(self.inputs(config, 1, session))  # what a dataplane's warm-up does
            memory = MemoryProbe.growth(before, self.probe.read())
            points = []
            for batch in batch_sizes(config.max_batch_size or 0, self.max_batch):
                self.progress(f"{config.name} {target.backend} {threads}t b{batch}", 0)
                inputs = self.inputs(config, batch, session)
                points.append(_time(session, inputs, batch, self.duration_s, self.min_runs))
            del inputs  # the input array is the client's memory, not the session's
            memory = max(memory, MemoryProbe.growth(before, self.probe.read()))
        finally:
            session.close()
        max_b = max(1, config.max_batch_size or 1)
        return Trial(target.backend, threads, points, memory, max_b, target.converted)


def _model_path(target: Target, tmp: Path) -> Path:
    if not target.converted:
        return target.path
    from shared.modeltools.convert import convert_to_openvino

    return convert_to_openvino(target.path, tmp, progress=False)


#: runs per point at most (docs/tuning.md): a microsecond model's 10 s point held
#: millions of timings
MAX_RUNS = 10_000


def _time(
    session: Session, inputs: dict[str, np.ndarray], batch: int, duration_s: float, min_runs: int
) -> Point:
    session.run(inputs)  # first run at this shape: allocations, kernel choice
    times: list[float] = []
    until = time.perf_counter() + duration_s
    while len(times) < min_runs or time.perf_counter() < until:
        start = time.perf_counter()
        session.run(inputs)
        times.append(time.perf_counter() - start)
        if len(times) >= MAX_RUNS:
            break
    arr = np.array(times)
    return Point(
        batch=batch,
        p50_s=float(np.percentile(arr, 50)),
        p99_s=float(np.percentile(arr, 99)),
        mean_s=float(arr.mean()),
        runs=len(times),
    )
