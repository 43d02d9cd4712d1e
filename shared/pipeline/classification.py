"""Triton's classification extension: top-k of an output as "value:index" strings.

A requested output whose parameters carry ``classification`` (what
tritonclient's ``InferRequestedOutput(name, class_count=k)`` sends; Ferry
also reads ``class_count``) comes back as a BYTES tensor of shape
``[batch, k]`` (``[k]`` for a model without a batch dimension) holding
``"<value>:<index>"`` for the k largest elements of each item, largest
first, ties broken by the lower index.  Values print as C's ``%f`` for
floating-point outputs and as integers otherwise, as Triton prints them.
k larger than the number of classes returns every class.  Where the model's
``[[postprocess]]`` names a labels file for the output, ``":<label>"`` is
added, as Triton adds its ``label_filename``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.errors import InvalidInput
from shared.messages import InferRequest
from shared.pipeline import post
from shared.repository import ModelConfig

_KEYS = ("classification", "class_count")


def requested_classes(config: ModelConfig, request: InferRequest) -> dict[str, int] | None:
    """Output name -> k for every output asked for as a classification (None: none)."""
    if request.outputs is None:
        return None
    found: dict[str, int] | None = None
    for out in request.outputs:
        params = out.parameters
        if not params:
            continue
        for key in _KEYS:
            if key not in params:
                continue
            k = params[key]
            if type(k) is not int or k < 0:
                raise InvalidInput(
                    f"output {out.name!r}: {key} must be a non-negative integer, got {k!r}"
                )
            if k == 0:  # 0 means "no classification", as in tritonclient
                continue
            spec = next((t for t in config.outputs if t.name == out.name), None)
            if spec is not None and spec.datatype == "BYTES":
                raise InvalidInput(f"output {out.name!r} is BYTES: it cannot be classified")
            if found is None:
                found = {}
            found[out.name] = k
    return found


def top_k(
    array: np.ndarray, k: int, batched: bool, labels: Sequence[str] | None = None
) -> np.ndarray:
    """The classification strings (bytes) of ``array``; see the module docstring."""
    return post.top_k(array, k, labels, 1 if batched else 0)
