"""Checking a request against a loaded model's configuration, before the batcher.

Pure functions of the request and the completed :class:`ModelConfig`, so the
dataplane can count whatever they refuse in the model's statistics before
anything is queued.
"""

from __future__ import annotations

import numpy as np

from shared.errors import InvalidInput
from shared.messages import InferRequest
from shared.repository import ModelConfig
from shared.tensors import Tensor


def dims_match(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(
        e in (-1, g) for e, g in zip(expected, got, strict=True)
    )


def validated_inputs(config: ModelConfig, request: InferRequest) -> dict[str, np.ndarray]:
    expected = {t.name: t for t in config.inputs}
    given: dict[str, np.ndarray] = {}
    batch: int | None = None
    for tensor in request.inputs:
        spec = expected.get(tensor.name)
        if spec is None:
            raise InvalidInput(
                f"model {config.name!r} has no input {tensor.name!r}; inputs are {sorted(expected)}"
            )
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"input {tensor.name!r}: expected datatype {spec.datatype}, got {tensor.datatype}"
            )
        shape = tensor.shape
        if config.max_batch_size:
            if config.max_batch_size_inferred:  # any size the runtime takes (see ModelConfig)
                if not shape:
                    raise InvalidInput(
                        f"input {tensor.name!r}: expected a first (batch) dimension, got a scalar"
                    )
            elif not shape or not 1 <= shape[0] <= config.max_batch_size:
                raise InvalidInput(
                    f"input {tensor.name!r}: batch dimension must be 1..{config.max_batch_size}, "
                    f"got shape {list(shape)}"
                )
            if batch is not None and shape[0] != batch and not config.max_batch_size_inferred:
                # (an inferred size is a guess from dynamic dims, not a declared batch
                # axis: [N, K] and [1, K] may broadcast; such a request runs alone)
                raise InvalidInput("all inputs of a request must share one batch size")
            batch = shape[0]
            inner = shape[1:]
        else:
            inner = shape
        if spec.ranked and not dims_match(spec.dims, inner):
            want = ([-1] if config.max_batch_size else []) + list(spec.dims)
            raise InvalidInput(f"input {tensor.name!r}: expected shape {want}, got {list(shape)}")
        given[tensor.name] = tensor.data
    missing = sorted(set(expected) - set(given))
    if missing:
        raise InvalidInput(f"model {config.name!r}: missing inputs {missing}")
    return given


def validated_outputs(config: ModelConfig, request: InferRequest) -> list[str] | None:
    names = request.output_names()
    if names is None:
        return None
    known = {t.name for t in config.outputs}
    for name in names:
        if name not in known:
            raise InvalidInput(
                f"model {config.name!r} has no output {name!r}; outputs are {sorted(known)}"
            )
    return names


def output_tensor(name: str, array: np.ndarray, config: ModelConfig) -> Tensor:
    for spec in config.outputs:
        if spec.name == name:
            return Tensor(name, spec.datatype, array)
    return Tensor.from_array(name, array)
