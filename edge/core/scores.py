"""Top-1 confidence of a model's scores, as the cascade and the profiler read it."""

from __future__ import annotations

import numpy as np

# A quantized softmax does not sum to exactly 1 (an int8 model's rows sum to
# ~0.99); re-applying softmax to probabilities would flatten them toward
# uniform, so rows this close to 1 are taken as probabilities already.
PROBABILITY_SUM_TOLERANCE = 0.02


def confidence(values: np.ndarray) -> float:
    """Top-1 confidence of one row of scores (softmax unless already probabilities)."""
    row = np.asarray(values, dtype=np.float64).reshape(-1)
    if row.size == 0:
        return 0.0
    if not np.all(np.isfinite(row)):
        return 0.0  # a NaN score is no evidence for any class
    if row.min() < 0 or row.max() > 1 or abs(row.sum() - 1.0) > PROBABILITY_SUM_TOLERANCE:
        e = np.exp(row - row.max())
        row = e / e.sum()
    else:
        row = row / row.sum()
    return float(row.max())
