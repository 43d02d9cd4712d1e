"""Triton's ``reshape``: a tensor served in one shape and fed to the model in another.

A Triton config writes ``dims: [1]  reshape: { shape: [ ] }`` for a model whose
input is one value per batch item (``[N]`` in the file) while clients send
``[N, 1]``; or ``dims: [784]  reshape: { shape: [28, 28] }``.  The session
here shows the config's dims (what clients send and the metadata says) and
reshapes on the way in and out (a view, no copy, for contiguous arrays).  The
batch axis, where the model has one, stays in front untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.errors import ConfigError, InternalError, InvalidInput
from shared.runtimes.base import Cancel, Session, TensorSpec, cancellable


def reshaped(
    inner: Session,
    declared: list[TensorSpec],
    max_batch_size: int | None,
    where: str,
) -> Session:
    """``inner`` behind the reshapes ``declared`` asks for (itself when none does)."""
    wanted = {t.name: t for t in declared if t.reshape is not None}
    if not wanted:
        return inner
    found = {t.name: t for t in (*inner.inputs, *inner.outputs)}
    batched = max_batch_size > 0 if max_batch_size is not None else None
    for name, spec in wanted.items():
        actual = found.get(name)
        if actual is None or not actual.ranked:
            continue  # (the completion names a tensor the file lacks; any rank takes it)
        assert spec.reshape is not None
        rank, shape = len(actual.dims), spec.reshape
        if batched is None:  # max_batch_size left to infer: the file's rank tells
            batched = rank == len(shape) + 1 and actual.dims[0] == -1
        file_dims = actual.dims[1:] if batched else actual.dims
        key = f"{where}: key '{name}.reshape'"
        if len(file_dims) != len(shape) or any(
            f != s and f != -1 and s != -1 for f, s in zip(file_dims, shape, strict=False)
        ):
            raise ConfigError(
                f"{key}: the model file's {name!r} has dims {list(actual.dims)}"
                f"{' (a batch axis first)' if batched else ''}, not the reshape {list(shape)}"
            )
        if _pieces(spec.dims) != _pieces(shape):
            # Triton's rule: the same variable (-1) dimensions, in order, and the same
            # number of values in each fixed run around them
            raise ConfigError(
                f"{key}: dims {list(spec.dims)} and the reshape {list(shape)} do not hold "
                "the same values: each needs the same -1 dimensions, and the fixed "
                "dimensions around them the same products"
            )
    return ReshapedSession(inner, wanted, bool(batched))


def _pieces(shape: tuple[int, ...]) -> list[int]:
    """The products of the fixed runs around each -1 ([2, -1, 3, 4] -> [2, 12])."""
    pieces, run = [], 1
    for d in shape:
        if d == -1:
            pieces.append(run)
            run = 1
        else:
            run *= d
    return [*pieces, run]


def _target(item: tuple[int, ...], source: tuple[int, ...], shape: tuple[int, ...]) -> tuple:
    """``shape`` with each -1 given the size its counterpart has in ``item`` (an array's
    shape after the batch axis, described by ``source``), in order; what numpy cannot
    do with two -1s, or one in an empty batch."""
    if -1 not in shape:
        return shape
    sizes = iter([n for n, d in zip(item, source, strict=False) if d == -1])
    return tuple(next(sizes, 0) if d == -1 else d for d in shape)


class ReshapedSession:
    """``inner`` fed and read in the shapes its config declares."""

    def __init__(self, inner: Session, wanted: dict[str, TensorSpec], batched: bool) -> None:
        self.inner = inner
        self.backend = inner.backend
        self._batched = batched
        lead = (-1,) if batched else ()

        def shown(t: TensorSpec) -> TensorSpec:
            spec = wanted.get(t.name)
            return t if spec is None else TensorSpec(t.name, t.datatype, lead + spec.dims)

        self.inputs = [shown(t) for t in inner.inputs]
        self.outputs = [shown(t) for t in inner.outputs]
        names = {t.name for t in inner.inputs}
        # name -> (the shape it comes in, the shape it goes on in)
        self._in = {n: (s.dims, s.reshape) for n, s in wanted.items() if n in names}
        self._out = {n: (s.reshape, s.dims) for n, s in wanted.items() if n not in names}

    @property
    def cancellable(self) -> bool:
        return cancellable(self.inner)

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        return self._back(self.inner.run(self._feed(inputs), outputs))

    def run_cancellable(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel
    ) -> dict[str, np.ndarray]:
        run = self.inner.run_cancellable  # type: ignore[attr-defined]
        return self._back(run(self._feed(inputs), outputs, cancel))

    def _shape(
        self,
        array: np.ndarray,
        source: tuple[int, ...],
        shape: tuple[int, ...],
        name: str,
        output: bool = False,
    ) -> np.ndarray:
        lead = array.shape[:1] if self._batched else ()
        shape = _target(array.shape[len(lead) :], source, shape)
        try:
            return array.reshape(lead + shape)
        except ValueError:
            # an input the client sent in the wrong size; an output the model made in one
            # its config does not describe (the server's fault, not the client's)
            error = InternalError if output else InvalidInput
            raise error(
                f"tensor {name!r}: shape {list(array.shape)} cannot be reshaped to "
                f"{list(lead + shape)}"
            ) from None

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._in:
            return inputs
        feed = dict(inputs)
        for name, (source, shape) in self._in.items():
            if name in feed:
                assert shape is not None
                feed[name] = self._shape(np.asarray(feed[name]), source, shape, name)
        return feed

    def _back(self, result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, (source, dims) in self._out.items():
            if name in result:
                assert source is not None
                result[name] = self._shape(result[name], source, dims, name, output=True)
        return result

    def __getattr__(self, name: str) -> Any:  # the runtime's own (properties, options ...)
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()
