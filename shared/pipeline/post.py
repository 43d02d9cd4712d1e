"""Post-processing of one output: softmax, top-k with labels, argmax.

Top-k strings follow Triton's classification extension, ``"<score>:<index>"``
plus ``":<label>"`` when a labels file names the class, so a client that
reads Triton's classification output reads Ferry's unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.errors import InvalidInput


def softmax(array: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, computed in float64 and returned as float32."""
    x = array.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x.astype(np.float32)


def top_k(array: np.ndarray, k: int, labels: Sequence[str] | None, leading: int) -> np.ndarray:
    """The k best classes of each item as BYTES "score:index[:label]", best first.

    ``leading`` is the number of axes kept (the batch axis, when there is
    one); the rest of each item is flattened into the classes.
    """
    kept = array.shape[:leading]
    classes = int(np.prod(array.shape[leading:], dtype=np.int64))
    rows = array.reshape(int(np.prod(kept, dtype=np.int64)), classes)  # (no -1: may be empty)
    count = min(k, classes)
    is_float = array.dtype.kind == "f" or array.dtype.name == "bfloat16"
    # Integers are ranked and printed in their own type: through float64, 2**53 + 1 and
    # 2**53 were one value, and UINT64's largest printed as 2**64.
    values = rows.astype(np.float64) if is_float else rows
    # descending, ties in index order; ~x reverses an integer order without overflow
    # (unsigned, INT64's minimum) where -x would not
    order = np.argsort(-values if is_float else ~values, axis=1, kind="stable")[:, :count]
    out = np.empty((rows.shape[0], count), dtype=object)
    for i in range(rows.shape[0]):
        for j, index in enumerate(order[i]):
            value = values[i, index]
            text = f"{value:f}:{int(index)}" if is_float else f"{int(value)}:{int(index)}"
            if labels is not None and int(index) < len(labels):
                text += f":{labels[int(index)]}"
            out[i, j] = text.encode()
    return out.reshape((*kept, count))


def argmax(array: np.ndarray, labels: Sequence[str] | None, leading: int) -> np.ndarray:
    """Index of the largest element of each item ([..., 1]); its label as BYTES with labels."""
    kept = array.shape[:leading]
    classes = int(np.prod(array.shape[leading:], dtype=np.int64))
    if classes == 0 and array.size == 0 and int(np.prod(kept, dtype=np.int64)) > 0:
        raise InvalidInput(f"the output is {list(array.shape)}: no class to pick for an item")
    rows = array.reshape((*kept, classes))  # (no -1: may be empty)
    index = (
        np.argmax(rows, axis=-1).astype(np.int64)[..., None]
        if rows.size
        else (np.zeros((*kept, 1), np.int64))
    )
    if labels is None:
        return index
    out = np.empty(index.shape, dtype=object)
    flat = out.reshape(-1)
    for i, value in enumerate(index.reshape(-1).tolist()):
        # a class past the file's lines answers its index, as top-k and Triton's
        # classification leave its label out (a 500 failed the whole batch)
        flat[i] = (labels[value] if value < len(labels) else str(value)).encode()
    return out


def read_labels(path: str, where: str) -> tuple[str, ...]:
    """One label per line (Triton's label_filename format); blank trailing lines dropped."""
    from shared.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 * 1024 * 1024 + 1)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{where}: cannot read labels file {path}: {reason}") from None
    if len(text) > 16 * 1024 * 1024:
        raise ConfigError(f"{where}: labels file {path} is larger than 16 MiB")
    return tuple(text.rstrip("\n").split("\n")) if text.strip() else ()
