"""Online estimates the policy reads per request, learnt from real traffic.

Local latency per model (EWMA + a P-square high quantile), link bandwidth
and RTT per transport from each transfer's timing, cloud queue and compute
time from reply parameters.  Reads are attribute lookups; the state file is
small JSON written atomically, with ages stored relative to the save so a
restart (new monotonic clock) keeps their meaning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Final

from edge.core.normal import ppf
from edge.core.quantile import Ewma, P2Quantile

log = logging.getLogger(__name__)

SMALL_BYTES = 4096


#: The EWMA weight of a local model's latency.  A device's own runtime changes slowly
#: (thermal throttling over minutes), and while offloading wins nothing corrects a
#: mean that two slow runs pushed up: at 0.2 they made a 0.7 s model look like a
#: 0.95 s one and the agent offloaded at a loss for good (bench/policy_quality.py:
#: LOSS cells 6 -> 4 in the fast state's profile over 6 seeds).
LOCAL_ALPHA = 0.1
RATE_ALPHA = 0.3  # LogRate's EWMA (a module constant: compiled class bodies read no siblings)


class LatencyEstimator:
    """Mean (EWMA) and a high quantile of a latency, honest about how much it has seen.

    The quantile is the larger of a P-square estimate and a log-normal one
    whose spread is shrunk towards ``PRIOR_LOG_SD`` while samples are few
    (under ``TRUST_P2``):
    a P-square 95th percentile of three samples is their largest, which is
    how a fallback reserve ends up too short for the local run's tail.
    """

    PRIOR_LOG_SD: Final = 0.2  # a run-to-run spread of ~20% before it is measured
    # the prior counts as this many samples: five warm-up runs outweigh it
    PRIOR_WEIGHT: Final = 2.0
    TRUST_P2: Final = 20  # samples after which the P-square estimate stands alone

    def __init__(self, q: float = 0.95, alpha: float = 0.2) -> None:
        self._ewma = Ewma(alpha)
        self._q = P2Quantile(q)
        self._z = ppf(q)
        self._log_mean: float | None = None
        self._log_var = 0.0
        self.last_update: float | None = None

    @property
    def mean(self) -> float | None:
        return self._ewma.value

    @property
    def quantile(self) -> float | None:
        p2 = self._q.value
        n = self._ewma.count
        if self._log_mean is None or (p2 is not None and n >= self.TRUST_P2):
            return p2
        w0 = self.PRIOR_WEIGHT
        var = (n * self._log_var + w0 * self.PRIOR_LOG_SD**2) / (n + w0)
        parametric = math.exp(self._log_mean + self._z * math.sqrt(var))
        return parametric if p2 is None else max(p2, parametric)

    @property
    def count(self) -> int:
        return self._ewma.count

    def add(self, seconds: float, now: float) -> None:
        if seconds < 0 or seconds != seconds:
            return
        self._ewma.add(seconds)
        self._q.add(seconds)
        if seconds > 0:
            x = math.log(seconds)
            if self._log_mean is None:
                self._log_mean = x
            else:
                r = x - self._log_mean
                self._log_mean += 0.1 * r
                self._log_var = 0.9 * (self._log_var + 0.1 * r * r)
        self.last_update = now

    def stale(self, now: float, max_age_s: float) -> bool:
        return self.last_update is None or now - self.last_update > max_age_s

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "ewma": self._ewma.to_dict(),
            "q": self._q.to_dict(),
            "log": [self._log_mean, self._log_var],
            "age_s": None if self.last_update is None else now - self.last_update,
        }

    @property
    def q(self) -> float:
        return self._q.q

    def retarget(self, q: float) -> None:
        """Track another quantile; the new tracker starts empty (reads fall back to the mean)."""
        if q != self._q.q:
            self._q = P2Quantile(q)
            self._z = ppf(q)

    @classmethod
    def from_dict(cls, d: dict[str, Any], now: float, q: float | None = None) -> LatencyEstimator:
        e = cls()
        e._ewma = Ewma.from_dict(d["ewma"])
        e._q = P2Quantile.from_dict(d["q"])
        e._z = ppf(e._q.q)
        if "log" in d:
            e._log_mean, e._log_var = d["log"][0], float(d["log"][1])
        if q is not None:
            e.retarget(q)
        age = d.get("age_s")
        e.last_update = None if age is None else now - float(age)
        return e


# A typical received signal per link kind (dBm: LTE RSRP, 3G RSCP, WiFi RSSI):
# where the link profile's median throughput is taken to hold.
TYPICAL_SIGNAL_DBM = {"lte": -95.0, "3g": -85.0, "wifi": -65.0}
# Throughput falls by about half for each this many dB below the typical signal
# (low-SNR Shannon capacity; field measurements of LTE agree to within a factor).
HALVING_DB = 10.0


def signal_factor(kind: str, signal_dbm: float | None) -> float:
    """How much faster than its profile's median a link of ``kind`` is likely to be."""
    typical = TYPICAL_SIGNAL_DBM.get(kind)
    if signal_dbm is None or typical is None:
        return 1.0
    return min(max(2.0 ** ((signal_dbm - typical) / HALVING_DB), 1 / 32), 4.0)


class LogRate:
    """A belief over a link direction's rate: Gaussian in log(bps), widening with age.

    The mean follows the observed log rates (EWMA); the spread is the
    uncertainty of that mean: the observations' variance over their
    effective count.  Unobserved, the belief relaxes towards the link's long
    run, the profile's prior until this link has shown its own (an
    Ornstein-Uhlenbeck process with time constant ``REVERT_S``; see
    :meth:`at`): an old estimate is an uncertain one, and a bad spell long
    past stops ruling the link out, so a link not used for a while becomes
    worth trying again.  A two-sided CUSUM on the
    standardised residuals detects a shift in the link's behaviour (a
    handover, a tunnel, a new cell) and restarts the belief from the new
    level instead of averaging the old regime in.
    """

    ALPHA: Final = RATE_ALPHA
    N_EFF: Final = (2 - RATE_ALPHA) / RATE_ALPHA  # an EWMA's effective sample count
    PRIOR_SIGMA: Final = 1.0  # a factor of e either way before anything is seen
    REVERT_S: Final = 60.0  # how fast what was learnt fades back into the long run
    CUSUM_K: Final = 0.5
    CUSUM_H: Final = 4.0
    # The link's own long run (where an unobserved belief relaxes to, see ``at``): the
    # last ~40 observations, trusted over the profile's prior as they gather
    # (half way at ``HOME_PRIOR_N``), their spread never taken below ``HOME_MIN_SIGMA``.
    HOME_ALPHA: Final = 0.05
    HOME_PRIOR_N: Final = 8.0
    HOME_MIN_SIGMA: Final = 0.35

    __slots__ = (
        "_far",
        "_h",
        "_hi",
        "_lo",
        "_log_prior",
        "_prior",
        "count",
        "home",
        "home_n",
        "home_var",
        "mu",
        "updated",
        "var",
    )

    def __init__(self) -> None:
        self.mu: float | None = None
        self.var = 0.25  # observation variance of log rate (a guess until measured)
        self.count = 0
        self.updated: float | None = None
        self._hi = self._lo = 0.0
        self.home: float | None = None  # long-run mean log rate (every regime)
        self.home_var = self.PRIOR_SIGMA**2
        self.home_n = 0
        # (what ``at`` reads per option, worked out when an observation changes it)
        self._h = 0.0  # the long run's weight against the prior
        self._far = self.PRIOR_SIGMA**2  # the variance the belief relaxes to
        self._prior, self._log_prior = 0.0, 0.0  # the last prior seen, and its log

    def _settle(self) -> None:
        """The long run's weight and variance (after ``home`` moved)."""
        if self.home is None:
            self._h, self._far = 0.0, self.PRIOR_SIGMA**2
            return
        h = self.home_n / (self.home_n + self.HOME_PRIOR_N)
        spread = min(max(self.home_var, self.HOME_MIN_SIGMA**2), self.PRIOR_SIGMA**2)
        self._h, self._far = h, h * spread + (1.0 - h) * self.PRIOR_SIGMA**2

    def weight(self, now: float) -> float:
        """How much of the learnt mean still holds (1 fresh, 0 faded into the long run)."""
        if self.mu is None or self.updated is None:
            return 0.0
        return math.exp(-max(now - self.updated, 0.0) / self.REVERT_S)

    def sigma(self, now: float) -> float:
        """The spread of the belief in the current mean log rate."""
        return self.at(1.0, 1.0, now)[1]

    def at(self, learnt_bps: float, prior_bps: float, now: float) -> tuple[float, float]:
        """(rate, sigma) at ``now`` in one pass: what the policy reads per option.

        Unobserved, the belief relaxes from what was learnt to the link's long
        run: the profile's prior (``prior_bps``, spread ``PRIOR_SIGMA``) at
        first, then more and more the rates this link has shown over all its
        regimes (their mean and spread).  A link that has always been slower
        than its kind's median then stops looking like the median (and worth
        a wake-up or an exploration) a minute after each visit, while one whose
        rate swings keeps a wide belief and is tried again.
        """
        updated = self.updated
        if self.mu is None or updated is None:
            return (learnt_bps if learnt_bps > 0 else prior_bps), self.PRIOR_SIGMA
        # (plain comparisons, not min/max: this runs for every option of every request)
        w = math.exp((updated - now) / self.REVERT_S) if now > updated else 1.0
        n = self.count
        var = self.var / (n if n < self.N_EFF else self.N_EFF)
        sigma = math.sqrt(var * w * w + self._far * (1 - w * w))
        if w >= 0.999 or learnt_bps <= 0 or prior_bps <= 0:
            return (learnt_bps if learnt_bps > 0 else prior_bps), sigma
        if prior_bps != self._prior:
            self._prior, self._log_prior = prior_bps, math.log(prior_bps)
        target = self._log_prior
        if self.home is not None:
            target += self._h * (self.home - target)
        return math.exp(w * math.log(learnt_bps) + (1 - w) * target), sigma

    def rate(self, learnt_bps: float, prior_bps: float, now: float) -> float:
        """``learnt_bps`` relaxed towards the long run by the belief's age (see :meth:`at`)."""
        return self.at(learnt_bps, prior_bps, now)[0]

    def add(self, bps: float, now: float) -> bool:
        """Observe one rate; True when it revealed a change of regime."""
        if not bps > 0:
            return False
        x = math.log(bps)
        self.updated = now
        if self.home is None:
            self.home, self.home_n = x, 1
        else:
            self.home_n += 1
            a = 1.0 / self.home_n if self.home_n * self.HOME_ALPHA < 1.0 else self.HOME_ALPHA
            d = x - self.home
            self.home += a * d
            # (the first observations say little of the spread: it starts at the prior's)
            self.home_var = (1 - a) * (self.home_var + a * d * d)
        self._settle()
        if self.mu is None:
            self.mu, self.count = x, 1
            return False
        r = x - self.mu
        z = r / math.sqrt(self.var + 1e-6)
        self._hi = max(0.0, self._hi + z - self.CUSUM_K)
        self._lo = max(0.0, self._lo - z - self.CUSUM_K)
        if self.count >= 3 and (self._hi > self.CUSUM_H or self._lo > self.CUSUM_H):
            self.mu, self.count, self._hi, self._lo = x, 1, 0.0, 0.0
            return True
        a = self.ALPHA
        self.mu += a * r
        self.var = (1 - a) * (self.var + a * r * r)
        self.count += 1
        return False

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "mu": self.mu,
            "var": self.var,
            "n": self.count,
            "age_s": None if self.updated is None else now - self.updated,
            "home": [self.home, self.home_var, self.home_n],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], now: float) -> LogRate:
        b = cls()
        b.mu, b.var, b.count = d.get("mu"), float(d.get("var", 0.25)), int(d.get("n", 0))
        if b.mu is not None:
            b.count = max(b.count, 1)  # a belief has at least the sample that set it
        age = d.get("age_s")
        b.updated = None if age is None else now - float(age)
        home = d.get("home")
        if home is not None and home[0] is not None:
            b.home, b.home_var, b.home_n = float(home[0]), float(home[1]), int(home[2])
            b._settle()
        return b


def _low(tail: P2Quantile, mean: float) -> float:
    """A pessimistic rate: the slow-tail quantile once it has enough samples, never above the mean."""
    value = tail.value if tail.count >= 5 else None
    return mean if value is None or value <= 0 else min(value, mean)


class LinkEstimator:
    """Bandwidth per direction and RTT of one transport, priors until observed."""

    def __init__(
        self,
        prior_up_bps: float = 10e6,
        prior_down_bps: float = 20e6,
        prior_rtt_s: float = 0.03,
        q: float = 0.95,
    ) -> None:
        self._up = Ewma(0.3)
        self._down = Ewma(0.3)
        self._rtt = Ewma(0.2)
        self._rtt_q = P2Quantile(q)
        # The slow tail of each direction's throughput: the latency quantile the
        # deadline is checked against must carry the link's variance, not only RTT's.
        self._up_lo = P2Quantile(1 - q)
        self._down_lo = P2Quantile(1 - q)
        # What is known of each direction's rate, with its uncertainty (exploration reads it).
        self.up_belief = LogRate()
        self.down_belief = LogRate()
        self.changes = 0  # regime changes detected (a diagnostic)
        # Attempts and lost replies, decayed per attempt: P(no reply) of the next one.
        self._tries = 0.0
        self._lost = 0.0
        self._tried_at: float | None = None
        # The same over a long memory: how often this link loses replies at all
        self._slow_tries = 0.0
        self._slow_lost = 0.0
        self.prior_up_bps, self.prior_down_bps, self.prior_rtt_s = (
            prior_up_bps,
            prior_down_bps,
            prior_rtt_s,
        )
        self.last_update: float | None = None
        self.bandwidth_update: float | None = None  # probes refresh RTT, never this
        # RTT, like the rates, fades back into the link's long run while unobserved
        # (see rtt_at): its last sample's time, and the long run's mean log RTT.
        self.rtt_update: float | None = None
        self._rtt_home: float | None = None
        self._rtt_home_n = 0
        self._rtt_home_var = LogRate.PRIOR_SIGMA**2  # the long run's spread (log RTT)
        self._rtt_target = 0.0  # log RTT an old estimate fades to (set by _refresh)
        self._rtt_target_q = 0.0  # and its quantile's (an old estimate is an unsure one)
        self.exploring_since: float | None = None  # one exploring request at a time
        self.consecutive_failures = 0
        self.samples = 0
        self._refresh()

    def _refresh(self) -> None:
        self.up_bps = self._up.value or self.prior_up_bps
        self.down_bps = self._down.value or self.prior_down_bps
        self.rtt_s = self._rtt.value if self._rtt.value is not None else self.prior_rtt_s
        q = self._rtt_q.value
        self.rtt_quantile = max(q, self.rtt_s) if q is not None else self.rtt_s
        self.up_bps_low = _low(self._up_lo, self.up_bps)
        self.down_bps_low = _low(self._down_lo, self.down_bps)
        target = math.log(self.prior_rtt_s) if self.prior_rtt_s > 0 else math.log(1e-3)
        far = LogRate.PRIOR_SIGMA**2
        home = self._rtt_home
        if home is not None:
            n = float(self._rtt_home_n)
            h = n / (n + LogRate.HOME_PRIOR_N)
            target += h * (home - target)
            spread = min(max(self._rtt_home_var, LogRate.HOME_MIN_SIGMA**2), far)
            far = h * spread + (1.0 - h) * far
        self._rtt_target = target
        self._rtt_target_q = target + ppf(self._rtt_q.q) * math.sqrt(far)

    def rtt_at(self, now: float) -> tuple[float, float]:
        """(mean, quantile) RTT believed at ``now``: what was learnt, faded into the long run.

        An RTT seen only in a bad spell (an outage's late replies, a congested
        cell) must not stand for good: once it rules the cloud out nothing
        sends to correct it (probes refresh RTT only from a radio still up), and
        three 2.5 s replies kept a WiFi agent local for hours.  Unobserved, it
        relaxes with the rates' time constant (``LogRate.REVERT_S``) towards the
        RTTs this link has shown over its life, the profile's prior at first; its
        quantile towards their spread's (an old estimate is an unsure one: its tail
        had shrunk onto its mean, and deadlines the link misses one time in ten read
        as met once it had been idle two minutes).
        """
        updated = self.rtt_update
        mean, quantile = self.rtt_s, self.rtt_quantile
        if updated is None or now - updated < 0.06 or not mean > 0:  # (fresh: w > 0.999)
            return mean, quantile
        w = math.exp((updated - now) / LogRate.REVERT_S)
        faded = math.exp(w * math.log(mean) + (1.0 - w) * self._rtt_target)
        tail = math.exp(w * math.log(quantile) + (1.0 - w) * self._rtt_target_q)
        return faded, tail if tail > faded else faded

    def _add_rtt(self, rtt_s: float, now: float) -> None:
        self._rtt.add(rtt_s)
        self._rtt_q.add(rtt_s)
        self.rtt_update = now
        x = math.log(rtt_s)
        home = self._rtt_home
        self._rtt_home_n += 1
        if home is None:
            self._rtt_home = x
        else:
            n = self._rtt_home_n
            a = 1.0 / n if n * LogRate.HOME_ALPHA < 1.0 else LogRate.HOME_ALPHA
            d = x - home
            self._rtt_home = home + a * d
            # (the first samples say little of the spread: it starts at the prior's)
            self._rtt_home_var = (1 - a) * (self._rtt_home_var + a * d * d)

    def set_prior(self, up_bps: float, down_bps: float, rtt_s: float) -> None:
        self.prior_up_bps, self.prior_down_bps, self.prior_rtt_s = up_bps, down_bps, rtt_s
        self._refresh()

    def observe(
        self, sent_bytes: int, received_bytes: int, elapsed_s: float, server_s: float, now: float
    ) -> None:
        net = elapsed_s - max(server_s, 0.0)
        self._attempt(False, now)
        if not net > 0:
            return
        self.samples += 1
        self.consecutive_failures = 0
        self.last_update = now
        if sent_bytes < SMALL_BYTES and received_bytes < SMALL_BYTES:
            self._add_rtt(net, now)
        elif sent_bytes >= received_bytes:
            t = net - self.rtt_at(now)[0] - received_bytes * 8 / self.down_bps
            rate = sent_bytes * 8 / max(t, net * 0.1, 1e-4)
            self._add_rate(rate, self._up, "_up_lo", self.up_belief, now)
        else:
            t = net - self.rtt_at(now)[0] - sent_bytes * 8 / self.up_bps
            rate = received_bytes * 8 / max(t, net * 0.1, 1e-4)
            self._add_rate(rate, self._down, "_down_lo", self.down_belief, now)
        self._refresh()

    def _add_rate(self, rate: float, mean: Ewma, tail: str, belief: LogRate, now: float) -> None:
        if belief.add(rate, now):
            # A new regime: forget the old one's level and slow tail at once.
            self.changes += 1
            mean.value = None
            setattr(self, tail, P2Quantile(getattr(self, tail).q))
        mean.add(rate)
        getattr(self, tail).add(rate)
        self.bandwidth_update = now

    FAIL_PRIOR: Final = (0.1, 10.0)  # Beta(lost, answered) before any attempt: ~1%
    FAIL_DECAY: Final = 0.97  # per attempt: the last ~30 attempts tell
    FAIL_SLOW_DECAY: Final = 0.995  # per attempt, the long memory: the last ~200 attempts
    FAIL_SLOW_S: Final = 1800.0  # and it fades over half an hour
    FAIL_SLOW_PRIOR: Final = (0.3, 30.0)  # ~1% again, but one lost reply is not a habit

    def failure_rate(self, now: float) -> float:
        """P(an offload over this link gets no reply), from the attempts.

        The recent attempts' counts fade with attempts and, like the rate
        belief, with time (``LogRate.REVERT_S``): an outage long past stops
        counting against the link even if nothing was sent since.  But a link
        whose outages come and go (a commute, a cell edge) loses the first
        replies of each new one, which the last minute cannot foresee; so the
        rate is at least the one a long memory (``FAIL_SLOW_*``) has seen.
        """
        a, b = self.FAIL_PRIOR
        if self._tried_at is None:
            return a / (a + b)
        age = now - self._tried_at
        fade = math.exp(-age / LogRate.REVERT_S) if age > 0.0 else 1.0
        recent = (self._lost * fade + a) / (self._tries * fade + a + b)
        if not self._slow_lost:  # never lost one: the long memory holds more answers
            return recent
        slow = math.exp(-age / self.FAIL_SLOW_S) if age > 0.0 else 1.0
        a, b = self.FAIL_SLOW_PRIOR
        long = (self._slow_lost * slow + a) / (self._slow_tries * slow + a + b)
        return recent if recent > long else long

    def _attempt(self, lost: bool, now: float) -> None:
        fade, slow = self.FAIL_DECAY, self.FAIL_SLOW_DECAY
        if self._tried_at is not None:
            age = now - self._tried_at if now > self._tried_at else 0.0
            fade *= math.exp(-age / LogRate.REVERT_S)
            slow *= math.exp(-age / self.FAIL_SLOW_S)
        self._tries = self._tries * fade + 1.0
        self._lost = self._lost * fade + (1.0 if lost else 0.0)
        self._slow_tries = self._slow_tries * slow + 1.0
        self._slow_lost = self._slow_lost * slow + (1.0 if lost else 0.0)
        self._tried_at = now

    def observe_probe(self, rtt_s: float, now: float) -> None:
        if rtt_s > 0:
            self._add_rtt(rtt_s, now)
            self.last_update = now
            self.consecutive_failures = 0
            self._refresh()

    def observe_failure(self, now: float) -> None:
        self.consecutive_failures += 1
        self._attempt(True, now)

    def observe_timeout(self, sent_bytes: int, elapsed_s: float, now: float) -> None:
        """A transfer that did not finish in ``elapsed_s``: the uplink is at most that fast.

        A censored sample: it can only lower the estimate, so a link that
        degraded stops looking fast after one timeout instead of after the
        breaker opens.
        """
        self.consecutive_failures += 1
        self._attempt(True, now)
        if sent_bytes >= SMALL_BYTES and elapsed_s > 0:
            bound = sent_bytes * 8 / elapsed_s
            self._up_lo.add(bound)
            # Against the rate believed now: the belief fades back to the long run while
            # unobserved, so a link that keeps timing out at the same bound must keep
            # saying so (compared with the faded-from mean, the same bound said nothing
            # and the fading belief invited the same failed attempt again and again).
            believed = self.up_belief.rate(self.up_bps, self.prior_up_bps, now)
            if bound < believed:
                self.up_belief.add(bound, now)
                if bound < self.up_bps:
                    self._up.value = bound
                    self._up.count += 1
                self.last_update = now
                self._refresh()
            self.bandwidth_update = now

    def stale(self, now: float, max_age_s: float) -> bool:
        return self.last_update is None or now - self.last_update > max_age_s

    def retarget(self, q: float) -> None:
        if q != self._rtt_q.q:
            self._rtt_q = P2Quantile(q)
            self._up_lo, self._down_lo = P2Quantile(1 - q), P2Quantile(1 - q)
            self._refresh()

    def rates(self, now: float) -> tuple[float, float]:
        """(up, down) bps as believed at ``now``: learnt rates, faded towards the priors."""
        return (
            self.up_belief.rate(self.up_bps, self.prior_up_bps, now),
            self.down_belief.rate(self.down_bps, self.prior_down_bps, now),
        )

    def transfer_time(self, up_bytes: int, down_bytes: int) -> float:
        return self.rtt_s + up_bytes * 8 / self.up_bps + down_bytes * 8 / self.down_bps

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "up": self._up.to_dict(),
            "down": self._down.to_dict(),
            "rtt": self._rtt.to_dict(),
            "rtt_q": self._rtt_q.to_dict(),
            "up_lo": self._up_lo.to_dict(),
            "down_lo": self._down_lo.to_dict(),
            "samples": self.samples,
            "attempts": [
                self._tries,
                self._lost,
                None if self._tried_at is None else now - self._tried_at,
                self._slow_tries,
                self._slow_lost,
            ],
            "up_belief": self.up_belief.to_dict(now),
            "down_belief": self.down_belief.to_dict(now),
            "prior": [self.prior_up_bps, self.prior_down_bps, self.prior_rtt_s],
            "age_s": None if self.last_update is None else now - self.last_update,
            "bw_age_s": None if self.bandwidth_update is None else now - self.bandwidth_update,
            "rtt_home": [
                self._rtt_home,
                self._rtt_home_n,
                None if self.rtt_update is None else now - self.rtt_update,
                self._rtt_home_var,
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], now: float, q: float | None = None) -> LinkEstimator:
        e = cls(*[float(x) for x in d["prior"]])
        e._up, e._down, e._rtt = (
            Ewma.from_dict(d["up"]),
            Ewma.from_dict(d["down"]),
            Ewma.from_dict(d["rtt"]),
        )
        e._rtt_q = P2Quantile.from_dict(d["rtt_q"])
        if "up_lo" in d:
            e._up_lo = P2Quantile.from_dict(d["up_lo"])
            e._down_lo = P2Quantile.from_dict(d["down_lo"])
        if q is not None and q != e._rtt_q.q:
            e.retarget(q)
        e.samples = int(d.get("samples", 0))
        if "attempts" in d:
            tries, lost, age, *slow = d["attempts"]  # (older state files: no long memory)
            e._tries, e._lost = float(tries), float(lost)
            if slow:
                e._slow_tries, e._slow_lost = float(slow[0]), float(slow[1])
            else:
                e._slow_tries, e._slow_lost = e._tries, e._lost
            e._tried_at = None if age is None else now - float(age)
        if "up_belief" in d:
            e.up_belief = LogRate.from_dict(d["up_belief"], now)
            e.down_belief = LogRate.from_dict(d["down_belief"], now)
        age = d.get("age_s")
        e.last_update = None if age is None else now - float(age)
        bw_age = d.get("bw_age_s")
        e.bandwidth_update = None if bw_age is None else now - float(bw_age)
        rtt_home = d.get("rtt_home")
        if rtt_home is not None:
            home, n, rtt_age, *spread = rtt_home
            if home is not None:
                e._rtt_home, e._rtt_home_n = float(home), int(n)
                if spread:
                    e._rtt_home_var = float(spread[0])
            e.rtt_update = None if rtt_age is None else now - float(rtt_age)
        elif e._rtt.value is not None:  # (older state files: the RTT is as old as the link's news)
            e.rtt_update = e.last_update
        e._refresh()
        return e


class Estimators:
    """Every estimate the policy reads, tracking one latency quantile throughout.

    ``quantile`` is the policy's ``deadline_quantile``: deadlines are checked
    against it, so local, RTT and cloud latency estimators all track it.
    """

    def __init__(self, quantile: float = 0.95) -> None:
        self.quantile = quantile
        self._local: dict[str, LatencyEstimator] = {}
        self._links: dict[str, LinkEstimator] = {}
        self._queue: dict[str, LatencyEstimator] = {}
        self._compute: dict[str, LatencyEstimator] = {}
        # Small agent state that must survive a restart with the estimates
        # (the data used today, for the daily cap); JSON-ready values only.
        self.extra: dict[str, Any] = {}

    def set_quantile(self, q: float) -> None:
        """Track another quantile (a reloaded policy); means and bandwidths are kept."""
        if q == self.quantile:
            return
        self.quantile = q
        for group in (self._local, self._queue, self._compute):
            for est in group.values():
                est.retarget(q)
        for link in self._links.values():
            link.retarget(q)

    def local(self, model: str, batch: int = 1) -> LatencyEstimator:
        key = model if batch == 1 else f"{model}@{batch}"
        found = self._local.get(key)
        if found is None:
            found = self._local[key] = LatencyEstimator(self.quantile, LOCAL_ALPHA)
        return found

    def local_known(self, model: str, batch: int) -> LatencyEstimator | None:
        """The estimator for ``batch`` if it has samples (no entry is created)."""
        found = self._local.get(model if batch == 1 else f"{model}@{batch}")
        return found if found is not None and found.count else None

    def link(self, transport: str) -> LinkEstimator:
        found = self._links.get(transport)
        if found is None:
            found = self._links[transport] = LinkEstimator(q=self.quantile)
        return found

    def reset_link(self, transport: str) -> None:
        """Forget what was learnt about ``transport`` (it now rides on another network)."""
        self._links.pop(transport, None)

    def set_link_prior(self, transport: str, up_bps: float, down_bps: float, rtt_s: float) -> None:
        self.link(transport).set_prior(up_bps, down_bps, rtt_s)

    def cloud_queue(self, model: str) -> LatencyEstimator:
        found = self._queue.get(model)
        if found is None:
            found = self._queue[model] = LatencyEstimator(self.quantile)
        return found

    def cloud_compute(self, model: str) -> LatencyEstimator:
        found = self._compute.get(model)
        if found is None:
            found = self._compute[model] = LatencyEstimator(self.quantile)
        return found

    def observe_reply(self, model: str, queue_us: int, compute_us: int, now: float) -> None:
        self.cloud_queue(model).add(queue_us / 1e6, now)
        self.cloud_compute(model).add(compute_us / 1e6, now)

    def stale_links(self, now: float, max_age_s: float) -> list[str]:
        return [name for name, link in self._links.items() if link.stale(now, max_age_s)]

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        return {
            "version": 1,
            "local": {k: v.to_dict(now) for k, v in self._local.items()},
            "links": {k: v.to_dict(now) for k, v in self._links.items()},
            "queue": {k: v.to_dict(now) for k, v in self._queue.items()},
            "compute": {k: v.to_dict(now) for k, v in self._compute.items()},
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], now: float, quantile: float = 0.95) -> Estimators:
        e = cls(quantile)
        q = quantile

        def latencies(key: str) -> dict[str, LatencyEstimator]:
            return {k: LatencyEstimator.from_dict(v, now, q) for k, v in d.get(key, {}).items()}

        e._local, e._queue, e._compute = (
            latencies("local"),
            latencies("queue"),
            latencies("compute"),
        )
        for local in e._local.values():  # the weight is the code's, not the saved state's
            local._ewma.alpha = LOCAL_ALPHA
        e._links = {k: LinkEstimator.from_dict(v, now, q) for k, v in d.get("links", {}).items()}
        e.extra = dict(d.get("extra", {}))
        return e

    def snapshot(self) -> bytes:
        """The state file's bytes; take it where the estimates are updated (the loop).

        Ages are kept relative to the save (a new process has a new monotonic
        clock); the wall clock of the save tells the next process how long the
        agent was down, which ages everything too (see :meth:`load`).
        """
        d = self.to_dict()
        d["saved_wall"] = time.time()
        return json.dumps(d).encode()

    def save(self, path: Path, data: bytes | None = None) -> None:
        """Write the state file atomically (``data`` from :meth:`snapshot`, or taken now)."""
        path = Path(path)
        data = self.snapshot() if data is None else data
        import tempfile  # only when saving: an agent's imports stay small on a device

        fd, tmp = tempfile.mkstemp(prefix=".estimates-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(
        cls, path: Path, now: float, quantile: float = 0.95, wall: float | None = None
    ) -> Estimators:
        """The saved estimates, aged by the time the agent was down (``wall``: now's).

        A restart after a day off must not price the link by the outage it
        stopped in (P(lost) 0.6 again, for the half hour the long memory
        takes) nor trust a day-old rate as fresh.  A clock that stepped back
        counts no downtime.
        """
        try:
            d = json.loads(Path(path).read_text())
            saved = d.get("saved_wall") if isinstance(d, dict) else None
            down = 0.0
            if isinstance(saved, (int, float)) and math.isfinite(saved):
                down = max((time.time() if wall is None else wall) - float(saved), 0.0)
            return cls.from_dict(d, now - down, quantile)
        except FileNotFoundError:
            return cls(quantile)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            log.warning("estimates in %s unreadable (%s); starting fresh", path, exc)
            return cls(quantile)
