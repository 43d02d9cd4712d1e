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
    """One model input as calibration sees it (-1 marks a dynamic dimension)."""

    name: str
    dtype: np.dtype
    dims: tuple[int, ...]


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


def folder_reader(
    folder: Path, specs: list[InputSpec], *, samples: int, batch_size: int
) -> ArrayReader:
    """Batches from ``folder``'s ``.npy``/``.npz`` files, sorted by name, at most ``samples``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidInput(f"calibration folder {folder} does not exist or is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz"))
    if not files:
        raise InvalidInput(f"calibration folder {folder} holds no .npy or .npz files")
    columns: dict[str, list[np.ndarray]] = {spec.name: [] for spec in specs}
    count = 0
    for path in files:
        if count >= samples:
            break
        arrays = _load_file(path, specs)
        n = None
        for spec in specs:
            array = _as_batch(arrays[spec.name], spec, path)
            if n is not None and array.shape[0] != n:
                raise InvalidInput(f"{path.name}: inputs hold different sample counts")
            n = array.shape[0]
            columns[spec.name].append(array)
        count += n or 0
    stacked = {name: np.concatenate(parts)[:samples] for name, parts in columns.items()}
    return ArrayReader(_split(stacked, specs, batch_size))


def random_reader(
    specs: list[InputSpec], *, samples: int, batch_size: int, seed: int = 0
) -> ArrayReader:
    """Standard-normal floats (a normalised image's range) or small integers; warns."""
    warnings.warn(
        "no calibration data given: calibrating on random inputs; activation ranges will "
        "not match real data and accuracy will suffer (pass a folder of .npy files)",
        CalibrationWarning,
        stacklevel=3,
    )
    rng = np.random.default_rng(seed)
    stacked: dict[str, np.ndarray] = {}
    for spec in specs:
        inner = spec.dims[1:]
        if any(d < 0 for d in inner):
            raise InvalidInput(
                f"input {spec.name!r} has dynamic dims {list(spec.dims)}: random calibration "
                "cannot guess a shape; give a calibration folder"
            )
        shape = (samples, *inner)
        if spec.dtype.kind == "f":
            stacked[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            stacked[spec.name] = rng.random(shape) < 0.5
        else:
            stacked[spec.name] = rng.integers(0, 100, size=shape).astype(spec.dtype)
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
    if array.ndim == len(spec.dims) - 1:
        array = array[None, ...]
    if array.ndim != len(spec.dims) or any(
        d >= 0 and d != a for d, a in zip(spec.dims[1:], array.shape[1:], strict=True)
    ):
        raise InvalidInput(
            f"{path.name}: input {spec.name!r} has shape {list(array.shape)}, "
            f"the model expects {list(spec.dims)}"
        )
    if array.dtype != spec.dtype:
        if array.dtype.kind != spec.dtype.kind:
            raise InvalidInput(
                f"{path.name}: input {spec.name!r} is {array.dtype}, the model expects {spec.dtype}"
            )
        array = array.astype(spec.dtype)
    return array


def _split(
    stacked: dict[str, np.ndarray], specs: list[InputSpec], batch_size: int
) -> list[dict[str, np.ndarray]]:
    """Cut the samples into batches; a fixed batch dimension wins over ``batch_size``."""
    fixed = {s.dims[0] for s in specs if s.dims and s.dims[0] > 0}
    size = fixed.pop() if len(fixed) == 1 else max(1, batch_size)
    total = min(len(a) for a in stacked.values())
    if total < size:
        raise InvalidInput(f"{total} calibration samples do not fill one batch of {size}")
    return [
        {name: np.ascontiguousarray(a[start : start + size]) for name, a in stacked.items()}
        for start in _starts(total, size)
    ]


def _starts(total: int, size: int) -> Iterator[int]:
    # Only whole batches: a model with a fixed batch dimension rejects a short tail.
    yield from range(0, total - size + 1, size)
