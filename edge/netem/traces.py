"""Link capacity traces: readers, a writer and seeded synthetic generators.

A trace is a list of *delivery opportunities* in the mahimahi sense: each
millisecond timestamp lets one 1500-byte packet cross the bottleneck, and the
schedule repeats every ``period_ms``.  Everything here (replay in the policy
evaluator, the live link emulator, plots) reads capacity through the same two
step functions, so a simulated transfer and an emulated one see the same link.

Time model: the schedule is periodic over all times, and an opportunity stamped
exactly ``period_ms`` (every mahimahi file ends with one) is the same instant as
phase 0 of the next period.  Hence ``bytes_between(0, period)`` is the whole
trace, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from shared.errors import ConfigError

#: the largest timestamp an int64 millisecond array holds
_MAX_MS = 2**63 - 1

#: Packets per millisecond per Mbps: 1e6 / 8 / 1500 / 1000.
_PKTS_PER_MS_PER_MBPS = 1.0 / 12.0
#: What one generated trace may hold: it is an array of delivery opportunities (one per
#: 1500-byte packet) and one of per-millisecond rates, so a rate or a length far past
#: any radio's must be refused before they are allocated (10 Gbps for a minute fits).
MAX_TRACE_PACKETS = 60_000_000
MAX_TRACE_MS = 86_400_000  # a day


def _ms(t_s: float) -> float:
    """Seconds to ms, snapping float noise so ``finish_time`` results round-trip exactly."""
    x = t_s * 1000.0
    r = round(x)
    return float(r) if abs(x - r) < 1e-6 else x


@dataclass(frozen=True, eq=False)
class Trace:
    """One direction of a link (``eq=False``: arrays make value equality ambiguous)."""

    name: str
    opportunities_ms: np.ndarray
    period_ms: int
    PACKET_BYTES: ClassVar[int] = 1500
    _phases: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        opp = np.ascontiguousarray(self.opportunities_ms, dtype=np.int64)
        if opp.ndim != 1:
            raise ConfigError(f"trace {self.name!r}: opportunities must be a 1-D array")
        period = int(self.period_ms)
        if period < 1:
            raise ConfigError(f"trace {self.name!r}: period_ms must be >= 1, got {period}")
        if opp.size:
            if opp[0] < 0 or opp[-1] > period:
                raise ConfigError(f"trace {self.name!r}: timestamps must lie in [0, {period}] ms")
            if np.any(np.diff(opp) < 0):
                raise ConfigError(f"trace {self.name!r}: timestamps must be non-decreasing")
        opp.setflags(write=False)
        # Phases in [0, period): stamps equal to the period move to phase 0 (see module doc).
        at_end = int(np.count_nonzero(opp == period))
        phases = np.concatenate([np.zeros(at_end, np.int64), opp[: opp.size - at_end]])
        phases.setflags(write=False)
        object.__setattr__(self, "opportunities_ms", opp)
        object.__setattr__(self, "period_ms", period)
        object.__setattr__(self, "_phases", phases)

    def __repr__(self) -> str:
        return (
            f"Trace({self.name!r}, {self._phases.size} opportunities, "
            f"period {self.period_ms} ms, {self.mean_mbps():.2f} Mbps)"
        )

    # -- the two step functions everything else is built on ---------------------------

    def opportunities_before(self, t_s: float) -> int:
        """Opportunities at times < ``t_s`` since time 0 (wrapping; negative before 0)."""
        n = self._phases.size
        if n == 0:
            return 0
        x = _ms(t_s)
        q = math.floor(x / self.period_ms)
        # stamps are integers, so "stamp < r" is "stamp < ceil(r)"; an integer key also
        # keeps numpy from converting the whole array to float on every call
        key = np.int64(math.ceil(x - q * self.period_ms))
        return q * n + int(self._phases.searchsorted(key, side="left"))

    def opportunity_time_s(self, index: int) -> float:
        """Time of the opportunity with global (wrapping) index ``index``."""
        n = self._phases.size
        if n == 0:
            return math.inf
        q, i = divmod(index, n)
        return (q * self.period_ms + int(self._phases[i])) / 1000.0

    # -- public views -------------------------------------------------------------------

    def mean_mbps(self) -> float:
        return self._phases.size * self.PACKET_BYTES * 8 / (self.period_ms / 1000.0) / 1e6

    def bytes_between(self, t0_s: float, t1_s: float) -> int:
        """Deliverable bytes in ``[t0, t1)`` (0 when ``t1 <= t0``)."""
        if t1_s <= t0_s:
            return 0
        count = self.opportunities_before(t1_s) - self.opportunities_before(t0_s)
        return count * self.PACKET_BYTES

    def capacity_mbps(self, start_s: float, window_s: float) -> float:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        return self.bytes_between(start_s, start_s + window_s) * 8 / window_s / 1e6

    def finish_time(self, start_s: float, nbytes: int) -> float:
        """When ``nbytes`` offered at ``start_s`` have crossed the link (inf: never).

        The last byte leaves with the ``ceil(nbytes/1500)``-th opportunity at or
        after ``start_s``; an outage simply pushes that opportunity later.
        """
        if nbytes <= 0:
            return start_s
        if self._phases.size == 0:
            return math.inf
        packets = -(-int(nbytes) // self.PACKET_BYTES)
        done = self.opportunity_time_s(self.opportunities_before(start_s) + packets - 1)
        return max(done, start_s)  # _ms() treats times within 1 ns as equal

    def series(
        self, step_s: float = 1.0, duration_s: float | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Window starts and the average Mbps in each window (one period by default)."""
        if step_s <= 0:
            raise ValueError("step_s must be positive")
        duration = self.period_ms / 1000.0 if duration_s is None else duration_s
        t = np.arange(0.0, duration, step_s)
        edges = np.append(t, t[-1] + step_s) if t.size else np.array([0.0])
        counts = self._counts(edges * 1000.0)
        mbps = np.diff(counts) * self.PACKET_BYTES * 8 / step_s / 1e6
        return t, mbps

    def _counts(self, x_ms: np.ndarray) -> np.ndarray:
        n = self._phases.size
        if n == 0:
            return np.zeros(x_ms.shape, np.int64)
        q = np.floor(x_ms / self.period_ms)
        keys = np.ceil(x_ms - q * self.period_ms).astype(np.int64)
        return q.astype(np.int64) * n + self._phases.searchsorted(keys, side="left")


# -- readers and writer ------------------------------------------------------------------


def read_mahimahi(path: Path) -> Trace:
    """One integer millisecond per line; non-decreasing (mahimahi rejects anything else)."""
    path = Path(path)
    text = _read_text(path)
    lines = text.splitlines()
    tokens = text.split()
    values: np.ndarray | None = None
    if tokens and len(tokens) == sum(1 for ln in lines if ln.strip()):
        try:
            values = np.fromiter(map(int, tokens), dtype=np.int64, count=len(tokens))
        except (ValueError, OverflowError):
            values = None
    if values is None or (values.size and (values[0] < 0 or np.any(np.diff(values) < 0))):
        values = _scan_mahimahi(path, lines)
    if values.size == 0:
        raise ConfigError(f"{path}: empty trace (expected one millisecond timestamp per line)")
    if values[-1] <= 0:  # mahimahi's mm-link refuses it too: its period would be 0
        raise ConfigError(
            f"{path}: the trace must last a nonzero time (its last timestamp is 0 ms)"
        )
    return Trace(path.name, values, int(values[-1]))


def _scan_mahimahi(path: Path, lines: list[str]) -> np.ndarray:
    """Slow path that finds the first bad line, for the error message."""
    out: list[int] = []
    for lineno, line in enumerate(lines, 1):
        s = line.strip()
        if not s:
            continue
        try:
            value = int(s)
        except ValueError:
            raise ConfigError(
                f"{path}:{lineno}: expected one integer millisecond timestamp, got {s[:40]!r}"
            ) from None
        if value < 0:
            raise ConfigError(f"{path}:{lineno}: negative timestamp {value}")
        if value > _MAX_MS:
            raise ConfigError(
                f"{path}:{lineno}: timestamp {value} ms is past {_MAX_MS} ms (about 292 million "
                "years); expected milliseconds from the trace's start"
            )
        if out and value < out[-1]:
            raise ConfigError(
                f"{path}:{lineno}: timestamp {value} goes back in time (after {out[-1]})"
            )
        out.append(value)
    return np.array(out, dtype=np.int64)


def read_tsmbps(path: Path) -> Trace:
    """Lines ``t_seconds mbps``: each rate holds until the next line's time.

    Times are relative to the first line.  The last rate holds for as long as the
    step before it (1 s when the file has a single line), which is how a log
    sampled at a fixed interval reads.  ``#`` starts a comment.
    """
    path = Path(path)
    times: list[float] = []
    rates: list[float] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        parts = s.split()
        try:
            if len(parts) != 2:
                raise ValueError
            t, mbps = float(parts[0]), float(parts[1])
        except ValueError:
            raise ConfigError(
                f"{path}:{lineno}: expected 't_seconds mbps', got {s[:60]!r}"
            ) from None
        if not (math.isfinite(t) and math.isfinite(mbps)) or mbps < 0:
            raise ConfigError(f"{path}:{lineno}: time and rate must be finite and the rate >= 0")
        if times and t <= times[-1]:
            raise ConfigError(
                f"{path}:{lineno}: time {t} is not after the previous line's {times[-1]}"
            )
        times.append(t)
        rates.append(mbps)
    if not times:
        raise ConfigError(f"{path}: empty trace (expected lines 't_seconds mbps')")
    last_step = times[-1] - times[-2] if len(times) > 1 else 1.0
    durations = [*np.diff(times).tolist(), last_step]
    _check_size(durations, rates, path.name)  # (before a day at 1e12 Mbps is allocated)
    return _from_segments(durations, rates, path.name)


def load_trace(path: str | Path) -> Trace:
    """Read either format, telling them apart by the first data line (1 or 2 columns)."""
    path = Path(path)
    for line in _read_text(path).splitlines():
        s = line.split("#", 1)[0].strip()
        if s:
            return read_tsmbps(path) if len(s.split()) == 2 else read_mahimahi(path)
    raise ConfigError(f"{path}: empty trace file")


def write_mahimahi(trace: Trace, path: Path) -> None:
    """Write one timestamp per line.

    The format's period is its last timestamp, so a trace ending in silence
    (last opportunity before ``period_ms``) reads back with a shorter period.
    """
    body = "\n".join(map(str, trace.opportunities_ms.tolist()))
    Path(path).write_text(body + "\n" if body else "")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read trace: {exc}") from None


# -- generators --------------------------------------------------------------------------


def _from_segments(durations_s: list[float], mbps: list[float], name: str) -> Trace:
    """Piecewise-constant rates to opportunities, spread evenly at ms resolution.

    A packet's opportunity is the end of the millisecond in which the running
    capacity total reaches it, so fractional packets carry over and the mean
    rate is exact.
    """
    bounds = np.round(np.cumsum(durations_s) * 1000.0).astype(np.int64)
    period = int(bounds[-1]) if bounds.size else 0
    if period < 1:
        raise ConfigError(f"trace {name!r}: total duration must be at least 1 ms")
    seg_ms = np.diff(bounds, prepend=0)
    per_ms = np.repeat(np.asarray(mbps, dtype=np.float64) * _PKTS_PER_MS_PER_MBPS, seg_ms)
    whole = np.floor(np.cumsum(per_ms) + 1e-9).astype(np.int64)
    counts = np.diff(whole, prepend=0)
    opps = np.repeat(np.arange(1, period + 1, dtype=np.int64), counts)
    return Trace(name, opps, period)


def _check_size(durations_s: list[float], mbps: list[float], name: str) -> None:
    """A generated trace within what one may hold (before its arrays are allocated)."""
    total_ms = float(np.sum(durations_s)) * 1000.0
    packets = float(np.dot(durations_s, mbps)) * 1000.0 * _PKTS_PER_MS_PER_MBPS
    if not total_ms <= MAX_TRACE_MS or not packets <= MAX_TRACE_PACKETS:  # (also NaN)
        raise ConfigError(
            f"trace {name!r}: {total_ms / 1000:.6g} s holding {packets:.6g} packets is past "
            f"what a generated trace may hold ({MAX_TRACE_MS / 1000:.0f} s, "
            f"{MAX_TRACE_PACKETS:,} packets)"
        )


def steady(mbps: float, seconds: float, name: str = "steady") -> Trace:
    """``mbps`` for ``seconds``; a trace loops, so a steady one too long or too dense to
    hold is kept shorter (the same link): any finite rate is a steady trace."""
    if not (0 <= mbps < math.inf and 0 < seconds < math.inf):
        raise ConfigError("steady trace needs a finite mbps >= 0 and seconds > 0")
    seconds = min(seconds, MAX_TRACE_MS / 1000.0)
    per_s = mbps * 1000.0 * _PKTS_PER_MS_PER_MBPS
    if per_s * seconds > MAX_TRACE_PACKETS:
        seconds = math.floor(MAX_TRACE_PACKETS / per_s * 1000.0) / 1000.0  # (whole ms: held)
        if seconds < 0.001:  # a trace's shortest step is a millisecond
            fastest = MAX_TRACE_PACKETS / 0.001 / (1000.0 * _PKTS_PER_MS_PER_MBPS)
            raise ConfigError(
                f"steady trace: {mbps:g} Mbps is past the fastest a trace may hold "
                f"({fastest:g} Mbps)"
            )
    return _from_segments([seconds], [mbps], name)


def from_phases(
    phases: list[tuple[float, float]], seed: int | None = None, name: str = "phases"
) -> Trace:
    """``[(seconds, mbps), ...]`` in order; 0 Mbps is an outage.

    With a seed, each 100 ms gets a multiplicative log-normal jitter (mean 1,
    about +-25%), as a real radio link wobbles around its nominal rate.
    """
    if not phases:
        raise ConfigError("from_phases needs at least one (seconds, mbps) phase")
    for seconds, mbps in phases:
        if seconds <= 0 or mbps < 0 or not math.isfinite(seconds * mbps):
            raise ConfigError(f"bad phase ({seconds}, {mbps}): seconds > 0 and mbps >= 0 required")
    _check_size([p[0] for p in phases], [p[1] for p in phases], name)
    if seed is None:
        return _from_segments([p[0] for p in phases], [p[1] for p in phases], name)
    rng = np.random.default_rng(seed)
    durations: list[float] = []
    rates: list[float] = []
    sigma = 0.25
    for seconds, mbps in phases:
        steps = max(1, round(seconds / 0.1))
        jitter = rng.lognormal(-(sigma**2) / 2, sigma, steps)
        durations.extend([seconds / steps] * steps)
        rates.extend((mbps * jitter).tolist())
    return _from_segments(durations, rates, name)


def markov_fading(
    seconds: float,
    seed: int,
    good_mbps: float = 12,
    bad_mbps: float = 0.5,
    p_good_to_bad: float = 0.1,
    p_bad_to_good: float = 0.3,
    step_s: float = 1.0,
    name: str = "markov",
) -> Trace:
    """Two-state (Gilbert-Elliott) fading: each step stays or flips with the given odds.

    ``bad_mbps=0`` makes the bad state a full outage (no capacity at all), as
    a cell edge or a tunnel is; a transfer started in it waits for the next
    good step.
    """
    if seconds <= 0 or step_s <= 0:
        raise ConfigError("markov_fading needs seconds > 0 and step_s > 0")
    if not (good_mbps > 0 and bad_mbps >= 0) or not math.isfinite(good_mbps + bad_mbps):
        raise ConfigError(
            f"markov_fading needs good_mbps > 0 and bad_mbps >= 0 (0: an outage), "
            f"got {good_mbps} and {bad_mbps}"
        )
    if not (0 <= p_good_to_bad <= 1 and 0 <= p_bad_to_good <= 1):
        raise ConfigError("markov_fading transition probabilities must lie in [0, 1]")
    steps = max(1, math.ceil(seconds / step_s - 1e-9))
    draws = np.random.default_rng(seed).random(steps)
    good = True
    rates: list[float] = []
    for u in draws:
        rates.append(good_mbps if good else bad_mbps)
        good = not (u < p_good_to_bad) if good else bool(u < p_bad_to_good)
    durations = [step_s] * steps
    durations[-1] = seconds - step_s * (steps - 1)
    return _from_segments(durations, rates, name)


def commute(seconds: float = 120, seed: int = 0, name: str = "commute") -> Trace:
    """Good WiFi, then weak LTE, a tunnel (no capacity at all), then LTE again.

    The seed moves the phase boundaries by a few percent, scales the rates and
    adds 100 ms jitter; the outage always lasts at least a second.
    """
    if seconds < 4:
        raise ConfigError("commute needs at least 4 seconds")
    rng = np.random.default_rng(seed)
    shares = np.array([0.25, 0.30, 0.10, 0.35]) * rng.uniform(0.85, 1.15, 4)
    outage = max(shares[2] / shares.sum() * seconds, 1.0)
    others = shares[[0, 1, 3]]
    lengths = np.insert(others / others.sum() * (seconds - outage), 2, outage)
    rates = [20.0, 2.0, 0.0, 7.0] * rng.uniform(0.8, 1.2, 4)
    phases = [(float(s), float(r)) for s, r in zip(lengths, rates, strict=True)]
    return from_phases(phases, seed=int(rng.integers(2**31)), name=name)


def trace_from_spec(spec: str) -> Trace:
    """A trace file, or a synthetic one.

    ``steady:MBPS`` (60 s), ``commute:SEED`` (120 s), ``markov:SEED`` (300 s,
    12 Mbps good, 0.5 Mbps bad) and ``markov-off:SEED`` (the same with the
    bad state a full outage).
    """
    if Path(spec).exists():
        return load_trace(spec)
    kind, sep, value = spec.partition(":")
    try:
        if sep and kind == "steady":
            return steady(float(value), 60.0, name=spec)
        if sep and kind == "commute":
            return commute(120.0, seed=int(value), name=spec)
        if sep and kind == "markov":
            return markov_fading(300.0, seed=int(value), name=spec)
        if sep and kind == "markov-off":
            return markov_fading(300.0, seed=int(value), bad_mbps=0.0, name=spec)
    except ValueError:
        raise ConfigError(f"bad synthetic trace {spec!r}") from None
    raise ConfigError(
        f"trace {spec!r}: no such file "
        "(or use steady:MBPS, commute:SEED, markov:SEED, markov-off:SEED)"
    )
