"""Top-1 confidence of a model's scores, as the cascade and the profiler read it."""

from __future__ import annotations

import numpy as np

# A quantized softmax does not sum to exactly 1 (an int8 model's rows sum to
# ~0.99); re-applying softmax to probabilities would flatten them toward
# uniform, so rows this close to 1 are taken as probabilities already.
PROBABILITY_SUM_TOLERANCE = 0.02


def confidence(values: np.ndarray) -> float:
    """Top-1 confidence of one row of scores (softmax unless already probabilities).

    Integer scores are a quantized output's levels (a full-integer LiteRT model's
    softmax: zero point 0, or the type's minimum for a signed one): they are read as
    shares of their row, where a softmax of the raw integers read every answer as
    certain.  A single score is a binary classifier's: max(p, 1 - p), where p is a
    probability, a sigmoid's logit, or a level of its integer type."""
    raw = np.asarray(values)
    if raw.dtype.kind in "iu" and raw.size:
        info = np.iinfo(raw.dtype)
        levels = raw.reshape(-1).astype(np.float64)
        if levels.size == 1:  # its place in the type's whole range
            p = (float(levels[0]) - info.min) / (float(info.max) - info.min)
            return max(p, 1.0 - p)
        if raw.dtype.kind == "i" and levels.min() < 0:
            levels = levels - info.min
        total = float(levels.sum())
        return float(levels.max()) / total if total > 0 else 0.0
    row = np.asarray(values, dtype=np.float64).reshape(-1)
    if row.size == 0:
        return 0.0
    if not np.all(np.isfinite(row)):
        return 0.0  # a NaN score is no evidence for any class
    if row.size == 1:
        p = float(row[0])
        if not 0.0 <= p <= 1.0:
            p = 1.0 / (1.0 + float(np.exp(-p)))  # a logit
        return max(p, 1.0 - p)
    if row.min() < 0 or row.max() > 1 or abs(row.sum() - 1.0) > PROBABILITY_SUM_TOLERANCE:
        e = np.exp(row - row.max())
        row = e / e.sum()
    else:
        row = row / row.sum()
    return float(row.max())
