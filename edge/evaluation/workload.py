"""The request workload a replay evaluation drives: arrivals, input sizes, deadlines.

Sizes and deadlines may be one value, a list (each request draws one of
them uniformly) or a ``{min, max}`` range (uniform), so a workload can mix
a thumbnail with a full frame, or tight and loose deadlines, without a new
file format.  Everything is drawn up front from the seed, so every policy
in one run sees exactly the same requests.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """A uniform range of values (inclusive)."""

    lo: float
    hi: float


#: One value, a list to pick from, or a uniform range.
Spread = float | tuple[float, ...] | Range


def _draw(spec: Spread, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(spec, Range):
        return rng.uniform(spec.lo, spec.hi, n)
    if isinstance(spec, tuple):
        return np.asarray(spec, dtype=np.float64)[rng.integers(len(spec), size=n)]
    return np.full(n, float(spec))


@dataclass(frozen=True)
class Requests:
    """The drawn workload: one entry per request, in arrival order."""

    arrivals: np.ndarray  # seconds from the start of the trace
    in_bytes: np.ndarray  # int64, bytes on the wire up
    deadlines_s: np.ndarray  # seconds each request has

    def __len__(self) -> int:
        return len(self.arrivals)


#: Bounds of a replay (each request is simulated; probes run every interval over the
#: whole span): past them a replay takes hours or all the memory, never an answer.
#: evaluate() checks them, for a workload from a file or built in Python alike.
MAX_REQUESTS = 1_000_000
MAX_REPLAY_S = 30 * 86_400.0


@dataclass(frozen=True)
class Workload:
    count: int = 500
    arrival: str = "poisson"  # poisson | periodic
    rate_per_s: float = 2.0
    # Bytes up per request as the agent counts them (tensor + ~256 B of envelope); the
    # default is the example model's real input, 1x3x224x224 FP32 = 602,112 B.
    # A number, a list to pick from, or a Range.
    input_bytes: Spread = 602_368
    output_bytes: int = 1_024
    # None: the policy file's deadline for the model (its deadline_ms, else the default)
    deadline_ms: Spread | None = None
    seed: int = 0
    # The device's battery at the start (None: mains power, or no battery reading)
    battery_percent: float | None = None
    # Data already used today when the replay starts (counts towards the daily cap)
    data_used_mb: float = 0.0

    def arrivals(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        if self.arrival == "periodic":
            return np.arange(self.count) / self.rate_per_s
        return np.cumsum(rng.exponential(1.0 / self.rate_per_s, self.count))

    def draw(self, default_deadline_ms: float) -> Requests:
        """Arrivals, sizes and deadlines, each from its own seeded stream."""
        n = self.count
        sizes = _draw(self.input_bytes, n, np.random.default_rng([self.seed, 1]))
        deadline = self.deadline_ms if self.deadline_ms is not None else default_deadline_ms
        deadlines = _draw(deadline, n, np.random.default_rng([self.seed, 2])) / 1000.0
        return Requests(self.arrivals(), np.round(sizes).astype(np.int64), deadlines)

    def typical_deadline_ms(self, default_deadline_ms: float) -> float:
        """The median deadline (what a static, offline choice plans for)."""
        spec = self.deadline_ms if self.deadline_ms is not None else default_deadline_ms
        if isinstance(spec, Range):
            return (spec.lo + spec.hi) / 2
        if isinstance(spec, tuple):
            return float(np.median(spec))
        return float(spec)

    def mean_in_bytes(self) -> float:
        spec = self.input_bytes
        if isinstance(spec, Range):
            return (spec.lo + spec.hi) / 2
        if isinstance(spec, tuple):
            return float(np.mean(spec))
        return float(spec)


_NUMBERS = ("count", "rate_per_s", "output_bytes", "seed", "battery_percent", "data_used_mb")
_SPREADS = ("input_bytes", "deadline_ms")
#: Bounds past which a replay's arithmetic breaks (bytes are int64 counters, and every
#: request is an array element): a clear error beats negative costs or a MemoryError.
_LIMITS = {
    "input_bytes": (1, 2**40),  # at least a byte once rounded: 0.4 would send nothing
    "output_bytes": (0, 2**40),
}


def _number(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path}: key {key!r}: expected a number, got {value!r}")
    if value < 0:
        raise ConfigError(f"{path}: key {key!r}: expected a non-negative number, got {value!r}")
    lo, hi = _LIMITS.get(key, (0, math.inf))
    if not lo <= value <= hi:
        raise ConfigError(
            f"{path}: key {key!r}: expected a number from {lo:g} to {hi:g}, got {value!r}"
        )
    return value


def _spread(path: Path, key: str, value: Any) -> Spread:
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{path}: key {key!r}: the list is empty")
        values = tuple(_number(path, key, v) for v in value)
        if min(values) <= 0:
            raise ConfigError(f"{path}: key {key!r}: values must be positive")
        return values
    if isinstance(value, dict):
        if set(value) != {"min", "max"}:
            raise ConfigError(f"{path}: key {key!r}: a range is {{min = ..., max = ...}}")
        lo, hi = _number(path, key, value["min"]), _number(path, key, value["max"])
        if not 0 < lo <= hi:
            raise ConfigError(f"{path}: key {key!r}: expected 0 < min <= max, got {lo}, {hi}")
        return Range(float(lo), float(hi))
    number = _number(path, key, value)
    if number <= 0:
        raise ConfigError(f"{path}: key {key!r}: expected a positive number, got {value!r}")
    return number


def load_workload(path: Path | None) -> Workload:
    """A workload TOML (every key optional); errors name the file and the key."""
    if path is None:
        return Workload()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read workload: {exc}") from None
    known = {f.name for f in fields(Workload)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}; expected one of {sorted(known)}")
        if key == "arrival":
            if value not in ("poisson", "periodic"):
                raise ConfigError(
                    f"{path}: key 'arrival': expected 'poisson' or 'periodic', got {value!r}"
                )
            values[key] = value
        elif key in _SPREADS:
            values[key] = _spread(Path(path), key, value)
        else:
            assert key in _NUMBERS
            values[key] = _number(Path(path), key, value)
    for key in ("count", "output_bytes", "seed"):
        if key in values:
            if values[key] != int(values[key]):
                raise ConfigError(f"{path}: key {key!r}: expected an integer")
            values[key] = int(values[key])
    if values.get("rate_per_s", 1.0) <= 0 or values.get("count", 1) < 1:
        raise ConfigError(f"{path}: 'rate_per_s' must be > 0 and 'count' >= 1")
    if values.get("battery_percent", 0) > 100:
        raise ConfigError(f"{path}: key 'battery_percent': expected 0..100")
    return Workload(**values)
