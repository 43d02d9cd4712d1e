"""Calibration data for static quantization.

Static QDQ needs the range of every activation, so it must see inputs that
look like production traffic.  Two sources: a folder of ``.npy`` files (one
input array each, with or without the batch dimension) or ``.npz`` files
(arrays keyed by input name, for multi-input models); or random data when the
user has none, which quantizes fine but picks ranges real inputs never hit,
so accuracy suffers and the user is warned.

The readers implement ONNX Runtime's ``CalibrationDataReader`` protocol
(``get_next() -> dict | None``) without subclassing it, so this module imports
nothing heavy.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import InvalidInput


class CalibrationWarning(UserWarning):
    """Quantization ran on data that does not represent the model's inputs."""


@dataclass(frozen=True)
class InputSpec:
    """One model input as calibration sees it (-1 marks a dynamic dimension; dims
    None: the file gives no shape, so any rank, and each file is fed as it is)."""

    name: str
    dtype: np.dtype
    dims: tuple[int, ...] | None


class ArrayReader:
    """Yields ``{input name: batch}`` dicts, then ``None`` (ORT's reader protocol)."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = batches
        self._next = 0

    def __len__(self) -> int:
        return len(self._batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._next >= len(self._batches):
            return None
        batch = self._batches[self._next]
        self._next += 1
        return batch

    def rewind(self) -> None:
        self._next = 0


class ProgressReader:
    """Wraps a reader so a progress bar advances once per calibration batch.

    The bar belongs to the caller (it spans the whole job); when the data
    runs out the bar's label moves on to ``after``, the work ONNX Runtime
    does next without telling anyone.
    """

    def __init__(self, reader: ArrayReader, bar: Any, *, after: str = "") -> None:
        self._reader = reader
        self._bar = bar
        self._after = after
        self._done = False

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = self._reader.get_next()
        if batch is not None:
            self._bar.update(1)
        elif not self._done:
            self._done = True
            if self._after:
                self._bar.set_postfix_str(self._after)
        return batch


def _batched(specs: list[InputSpec]) -> bool:
    """Whether every input leads with a batch dimension (dynamic, or one fixed size they
    share, as ``[1, 3, 224, 224]`` exports have): then samples from several files are
    stacked and cut into batches.  Otherwise (a scalar input, leading dims that differ
    such as a recurrent state's ``[2, ?, 128]`` beside ``[1, 512]``) each file is one
    feed, as given."""
    leads = {s.dims[0] if s.dims else None for s in specs}
    # all dynamic, or one fixed size every input shares (a lone fixed lead beside a
    # dynamic one is not a batch: a recurrent state's layer count)
    return None not in leads and (leads == {-1} or (len(leads) == 1 and -1 not in leads))


def folder_reader(
    folder: Path, specs: list[InputSpec], *, samples: int, batch_size: int
) -> ArrayReader:
    """Batches from ``folder``'s ``.npy``/``.npz`` files, sorted by name, at most ``samples``.

    Files whose arrays differ in a dynamic dimension (images of several sizes) are
    batched apart: the runtime takes each size, and stacking them is impossible."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidInput(f"calibration folder {folder} does not exist or is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz"))
    if not files:
        raise InvalidInput(f"calibration folder {folder} holds no .npy or .npz files")
    batched = _batched(specs)
    groups: dict[tuple, dict[str, list[np.ndarray]]] = {}  # inner shapes -> columns
    feeds: list[dict[str, np.ndarray]] = []
    count = 0
    for path in files:
        if count >= samples:
            break
        arrays = _load_file(path, specs)
        if not batched:
            feeds.append({s.name: _as_feed(arrays[s.name], s, path) for s in specs})
            count += 1
            continue
        n = None
        shaped = {}
        for spec in specs:
            array = _as_batch(arrays[spec.name], spec, path)
            if n is not None and array.shape[0] != n:
                raise InvalidInput(f"{path.name}: inputs hold different sample counts")
            n = array.shape[0]
            shaped[spec.name] = array
        key = tuple(shaped[s.name].shape[1:] for s in specs)
        columns = groups.setdefault(key, {s.name: [] for s in specs})
        for name, array in shaped.items():
            columns[name].append(array)
        count += n or 0
    if not batched:
        return ArrayReader(feeds)
    batches: list[dict[str, np.ndarray]] = []
    left = samples
    for columns in groups.values():
        if left <= 0:
            break
        stacked = {name: np.concatenate(parts)[:left] for name, parts in columns.items()}
        left -= min(len(a) for a in stacked.values())
        batches += _split(stacked, specs, batch_size, whole=len(groups) == 1)
    if not batches:
        raise InvalidInput(f"calibration folder {folder}: no whole batch of {batch_size}")
    return ArrayReader(batches)


def random_reader(
    specs: list[InputSpec], *, samples: int, batch_size: int, seed: int = 0
) -> ArrayReader:
    """Standard-normal floats (a normalised image's range), 0/1 integers (safe as an
    index into any table) or booleans; warns."""
    warnings.warn(
        "no calibration data given: calibrating on random inputs; activation ranges will "
        "not match real data and accuracy will suffer (pass a folder of .npy files)",
        CalibrationWarning,
        stacklevel=3,
    )
    rng = np.random.default_rng(seed)
    batched = _batched(specs)

    def draw(spec: InputSpec, shape: tuple[int, ...]) -> np.ndarray:
        if spec.dtype.kind == "f":
            return rng.standard_normal(shape).astype(spec.dtype)
        if spec.dtype.kind == "b":
            return rng.random(shape) < 0.5
        return rng.integers(0, 2, size=shape).astype(spec.dtype)

    for spec in specs:
        if spec.dims is None:
            raise InvalidInput(
                f"input {spec.name!r} has no shape in the model file (any rank): random "
                "calibration cannot guess one; give a calibration folder"
            )
        fixed = spec.dims[1:] if batched else spec.dims
        if any(d < 0 for d in fixed):
            raise InvalidInput(
                f"input {spec.name!r} has dynamic dims {list(spec.dims)}: random calibration "
                "cannot guess a shape; give a calibration folder"
            )
    if not batched:
        return ArrayReader([{s.name: draw(s, s.dims) for s in specs} for _ in range(samples)])
    stacked = {s.name: draw(s, (samples, *s.dims[1:])) for s in specs}
    return ArrayReader(_split(stacked, specs, batch_size))


def _load_file(path: Path, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                loaded = {key: archive[key] for key in archive.files}
        else:
            loaded = {"": np.load(path, allow_pickle=False)}
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read calibration file {path}: {exc}") from exc
    if "" in loaded:
        if len(specs) != 1:
            names = [s.name for s in specs]
            raise InvalidInput(
                f"{path.name}: the model has inputs {names}; use .npz files keyed by input name"
            )
        return {specs[0].name: loaded[""]}
    missing = [s.name for s in specs if s.name not in loaded]
    if missing:
        raise InvalidInput(f"{path.name} lacks inputs {missing} (it holds {sorted(loaded)})")
    return loaded


def _as_batch(array: np.ndarray, spec: InputSpec, path: Path) -> np.ndarray:
    """Add the batch dimension when missing, check the rest against the model."""
    assert spec.dims is not None  # (_batched: an input of any rank is fed file by file)
    if array.ndim == len(spec.dims) - 1:
        array = array[None, ...]
    if array.ndim != len(spec.dims) or any(
        d >= 0 and d != a for d, a in zip(spec.dims[1:], array.shape[1:], strict=True)
    ):
        raise InvalidInput(
            f"{path.name}: input {spec.name!r} has shape {list(array.shape)}, "
            f"the model expects {list(spec.dims)}"
        )
    return _typed(array, spec, path)


def _as_feed(array: np.ndarray, spec: InputSpec, path: Path) -> np.ndarray:
    """One file, one feed, its shape the model's (a leading 1 added where it fits)."""
    if spec.dims is None:  # any rank: the runtime judges the shape
        return np.require(_typed(array, spec, path), requirements="C")
    if array.ndim == len(spec.dims) - 1 and spec.dims[0] in (1, -1):
        array = array[None, ...]
    if array.ndim != len(spec.dims) or any(
        d >= 0 and d != a for d, a in zip(spec.dims, array.shape, strict=True)
    ):
        raise InvalidInput(
            f"{path.name}: input {spec.name!r} has shape {list(array.shape)}, "
            f"the model expects {list(spec.dims)}"
        )
    return np.require(_typed(array, spec, path), requirements="C")  # (keeps rank 0)


def _typed(array: np.ndarray, spec: InputSpec, path: Path) -> np.ndarray:
    if array.dtype != spec.dtype:
        if array.dtype.kind != spec.dtype.kind:
            raise InvalidInput(
                f"{path.name}: input {spec.name!r} is {array.dtype}, the model expects {spec.dtype}"
            )
        array = array.astype(spec.dtype)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        # one inf made every range infinite: a model answering one constant
        raise InvalidInput(f"{path.name}: input {spec.name!r} holds NaN or infinite values")
    return array


def _split(
    stacked: dict[str, np.ndarray], specs: list[InputSpec], batch_size: int, whole: bool = True
) -> list[dict[str, np.ndarray]]:
    """Cut the samples into batches; a fixed batch dimension wins over ``batch_size``.
    ``whole``: too few samples for one batch is an error (else: none from this group)."""
    fixed = {s.dims[0] for s in specs if s.dims and s.dims[0] > 0}
    size = fixed.pop() if len(fixed) == 1 else max(1, batch_size)
    total = min(len(a) for a in stacked.values())
    if total < size:
        if not whole:
            return []
        raise InvalidInput(f"{total} calibration samples do not fill one batch of {size}")
    return [
        {name: np.ascontiguousarray(a[start : start + size]) for name, a in stacked.items()}
        for start in _starts(total, size)
    ]


def _starts(total: int, size: int) -> Iterator[int]:
    # Only whole batches: a model with a fixed batch dimension rejects a short tail.
    yield from range(0, total - size + 1, size)
