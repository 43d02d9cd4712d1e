"""The per-request cost policy (DESIGN.md section 4).

For each feasible option (run locally, offload over MQTT, offload over HTTP)
the policy predicts latency (mean and a high quantile), energy in joules,
bytes and money from the online estimators and the device and link
profiles, drops options that break a hard constraint, and picks the one
with the lowest weighted cost.  It is pure arithmetic over numbers the
estimators keep ready, so one decision takes microseconds; the replay
evaluator calls this same code, so what a policy author simulates is what
the agent does.

Hard constraints: the deadline, checked against the latency *quantile*;
the battery floor (below it, energy becomes the objective); the daily data
cap; local-only and cloud-only models; no usable link -> local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from devices.profiles import DeviceProfile, LinkProfile
from edge.core.energy import (
    expected_tail_s,
    local_energy_j,
    tail_extension_s,
    transfer_energy_j,
)
from edge.core.estimators import Estimators

LOCAL = "local"
_CLOUD_NAMES = {t: f"cloud-{t}" for t in ("mqtt", "http")}
MODES = ("cost", "cascade", "local", "cloud")
TRANSPORTS = ("mqtt", "http")


def reduce_by_init(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of a frozen dataclass: rebuilt through ``__init__``.  Compiled
    (mypyc), a frozen class refuses the field-by-field restore that pickle and
    ``copy`` do otherwise."""
    return type(obj), tuple(getattr(obj, f.name) for f in fields(obj))


@dataclass(frozen=True)
class Weights:
    """Cost per unit: a second of latency, a joule, a megabyte, a unit of money."""

    latency_s: float = 1.0
    energy_j: float = 0.0
    data_mb: float = 0.0
    money: float = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True)
class ModelPolicy:
    """How one model may run; names map the app's model to local and cloud variants."""

    mode: str = "cost"
    local_model: str | None = None
    cloud_model: str | None = None
    deadline_ms: float | None = None
    cascade_threshold: float = 0.8
    cascade_output: str | None = None
    transports: tuple[str, ...] = TRANSPORTS
    output_bytes: int = 4096  # reply size prior until one is observed

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True)
class PolicyConfig:
    weights: Weights = field(default_factory=Weights)
    deadline_quantile: float = 0.95
    battery_floor_percent: float = 15.0
    data_cap_mb_per_day: float | None = None
    default_deadline_ms: float = 1000.0
    # An estimate older than this is no longer trusted to rule the link out of
    # a deadline, and an exploring request claims its link for this long (one at
    # a time per link); 0: never explore.  The requests an exploration's saving
    # is counted over are those expected within HORIZON_S.
    explore_after_s: float = 10.0
    # Timed local runs at start that seed the local latency estimate (after one that
    # pays first-call costs).  A race stops its local run when the cloud answers first
    # only once that estimate rests on LOCAL_RUNS_TO_CANCEL runs (edge/core/flow.py):
    # fewer seeds mean the first races run their local half to the end to learn it.
    warm_up_runs: int = 5
    models: dict[str, ModelPolicy] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(slots=True)
class Option:
    # (Field order: cloud_option passes its fields by position, in this order, up to
    # ``measured``: keyword arguments cost ~0.3 us more per option on the hot path.)
    name: str  # "local", "cloud-mqtt", "cloud-http"
    transport: str | None
    latency_s: float
    latency_q_s: float
    energy_j: float
    up_bytes: int
    down_bytes: int
    money: float
    stale: bool = False
    promotion_s: float = 0.0  # radio promotion included in the latency (cloud options)
    # d(cost)/d(1/bps) of the bottleneck direction, its mean rate and the spread of
    # the belief in it (log space): what exploration prices the option's upside with.
    cost_per_inv_bps: float = 0.0
    rate_bps: float = 0.0
    rate_sigma: float = 0.0
    bottleneck_s: float = 0.0  # the bottleneck direction's transfer time at the mean rate
    p_fail: float = 0.0  # P(no reply) from the link's recent attempts
    # What the option would cost with the radio already up (cloud options from an
    # idle radio): no promotion, the tail priced at the expected gap to the next request.
    warm_cost: float | None = None
    # What the cost drops by when the next request uses the radio too (its tail is
    # then shared, not paid to the end): 0 where every recent request used it.
    shared_saving: float = 0.0
    tail_s: float | None = None  # the radio tail it opens, at the request rate
    measured: bool = False  # the latency prediction rests on this link's own transfers
    # From a radio up: the rest of the tail share a run of offloads pays per request,
    # beyond what this one adds (choose() charges it when that run costs more than
    # running locally: a run is what staying on the radio is).
    run_extra: float = 0.0
    run_per_byte: float = 0.0  # d(cost)/d(bytes up), about: to price a typical request
    # Set by Policy.choose:
    cost: float = 0.0
    feasible: bool = True
    reason: str = ""
    strict_s: float | None = None  # strict_latency_s, once computed
    # An offload raced against the local run (see Policy._race): the local run
    # starts this many seconds after the decision unless the cloud has answered.
    race_s: float | None = None
    premium: float = 0.0  # what the race adds to the cost at the belief's median


@dataclass(slots=True)
class Context:
    """What the agent knows at decision time besides the estimators."""

    now: float
    deadline_s: float  # time left for this request
    in_bytes: int
    connected: dict[str, bool]  # transport -> usable (connected and breaker allows)
    battery_percent: float | None = None
    data_used_mb_today: float = 0.0
    radio_idle_s: float | None = None
    out_bytes: int | None = None
    batch: int = 1  # rows in the request (local latency is learnt per batch size)
    local_backlog: int = 0  # requests already waiting for or running on the local model
    rate_per_s: float | None = None  # the model's recent request rate (exploration's horizon)
    # The local run can be stopped halfway (its runtime takes a cancel): a race or
    # hedge whose cloud answers first pays only the part of the local run it made.
    local_cancellable: bool = False
    # Share of the recent requests that used the radio, or would have with it up (None:
    # not known yet): the tail an offload opens lasts until the next request that uses
    # the radio, not the next one.
    radio_share: float | None = None
    mean_in_bytes: float | None = None  # the model's recent requests' mean size


@dataclass(slots=True)
class Decision:
    choice: Option | None
    options: list[Option]
    reason: str = ""
    # Offload ``choice`` and run locally at once, answering with the first: an
    # exploration whose attempt leaves no room to fall back locally afterwards.
    hedge: bool = False
    exploring: bool = False  # chosen for what it teaches, not as the least cost

    @property
    def where(self) -> str:
        return self.choice.name if self.choice else "none"


LEAST_COST = "least cost"
#: how far above its mean (in the belief's spreads) a link's rate may be for a late
#: exploration to try it
LATE_EXPLORE_Z = 2.0
LOW_BATTERY = "low battery: least energy"


def explore_late_reason(o: Option) -> str:
    return f"no option meets the deadline: trying {o.name} beside the local run (explore)"


# Time kept back from the cloud for a local answer, as a multiple of the local
# latency quantile (room for the local run's own jitter), and at least enough
# to get the fallback scheduled at all.
FALLBACK_RESERVE = 1.15
FALLBACK_MIN_RESERVE_S = 0.02
# A cloud reply this many times later than its predicted latency quantile is
# given up on (the local fallback then answers sooner).
GIVE_UP_AFTER = 5.0
# How far past the deadline quantile an offload with no room for a local
# fallback must still fit (a multiple of its spread beyond the mean).
SAFE_TAIL = 2.5
SAFE_Z = 2.0
# The most P(no reply) a link may show for an offload to go without room to fall back.
SAFE_P_FAIL = 0.02
# Why an offload is not taken outright: no room for a local answer after it (it may
# still be explored as a hedge, beside a local run).
NO_ROOM = "no room to fall back"
# Transfers a link must have shown before its latency prediction is trusted to
# cut a wait short.
MEASURED_SAMPLES = 5
# How far ahead a decision's consequences are counted (what an exploration
# teaches, the warm run a wake-up starts), and the most requests credited.
HORIZON_S = 30.0
MAX_HORIZON = 20.0


def late_only_for_promotion(o: Option, deadline_s: float) -> bool:
    """Whether ``o`` misses the deadline only for waking the radio: warm, it makes it."""
    return o.reason == "deadline" and o.latency_q_s - o.promotion_s <= deadline_s


def fallback_reserve_s(local: Option) -> float:
    """Time to keep for the local run after an offload: the larger of its latency
    quantile and its mean plus 15%.

    Not the quantile plus 15%: while the local run rests on a few samples its
    quantile already carries the prior's spread (LatencyEstimator), and an agent
    that mostly offloads gathers no more; a margin on top of that margin started
    every race's local run at once, paying its energy beside nearly every reply."""
    reserve = local.latency_s * FALLBACK_RESERVE
    if reserve < local.latency_q_s:
        reserve = local.latency_q_s
    return reserve if reserve > FALLBACK_MIN_RESERVE_S else FALLBACK_MIN_RESERVE_S


def race_start_s(cloud: Option, due_s: float) -> float:
    """Seconds from now at which a race's local run starts (``due_s``: the latest that
    still makes the deadline).  On a measured link a reply long past its tail is more
    likely lost than late, so the local run need not wait for the last moment."""
    if cloud.measured:
        overdue = GIVE_UP_AFTER * cloud.latency_q_s
        if FALLBACK_MIN_RESERVE_S < overdue < due_s:
            return overdue
    return due_s


def _run_discount(o: Option, rate_per_s: float | None, latency_weight: float = 0.0) -> float:
    """What ``o`` would cost less per request once offloading is what the requests do.

    With the radio up, an offload pays the tail until the next request that
    uses the radio: while most recent requests ran locally that is a long
    tail (``o.shared_saving`` above the tail at the request rate).  The
    requests that would use what an exploration teaches are the offloads it
    leads to, each sharing the tail with the next (as likely as the next
    request comes within it): pricing them with this request's lone tail
    keeps a link that was slow once unexplored for good, since every
    request that stays local makes the next offload's tail longer.  From an
    idle radio the offloads it leads to are spared the wake-up's wait (they
    find the radio up as likely as the next request comes within the tail):
    charging every one of them the promotion kept a fast link behind a slow
    prior unexplored for good (2.4x always-cloud on a 50 Mbps link).  Its
    energy is not discounted: a run's tail is the wake-up rule's to weigh.
    """
    if not rate_per_s or o.tail_s is None:
        return 0.0
    p_next = rate_per_s * o.tail_s
    if p_next > 1.0:
        p_next = 1.0
    if o.promotion_s > 0.0:
        return latency_weight * o.promotion_s * p_next
    return o.shared_saving * p_next


def horizon_requests(rate_per_s: float | None) -> float:
    """Requests expected within HORIZON_S (at least 1, at most MAX_HORIZON)."""
    if not rate_per_s:
        return 1.0
    n = rate_per_s * HORIZON_S  # (plain comparisons: the decision's hot path)
    return 1.0 if n < 1.0 else MAX_HORIZON if n > MAX_HORIZON else n


def fallback_plan(
    now: float, deadline: float, local: Option | None, choice: Option
) -> tuple[float, Option | None]:
    """When to give up on the cloud, and the local option to fall back to.

    The cloud gets the deadline minus enough time to answer locally.  When
    local could not make the deadline anyway, the cloud gets all of it (but
    local stays the fallback for a cloud that fails fast).  The agent and the
    replay evaluator both call this, so they give up at the same moment.
    """
    if local is None:
        return max(deadline, now + choice.latency_q_s), None
    reserve = fallback_reserve_s(local)
    if reserve >= deadline - now:
        return deadline, local
    # The cloud gets at least its own tail (the one the deadline check trusted
    # when no local fallback fits after it): cutting it shorter abandons replies
    # that were on time, for a local answer that costs more.
    patience = strict_latency_s(choice)
    if not math.isfinite(patience):
        patience = choice.latency_q_s
    give_up = min(max(deadline - reserve, now + patience), deadline)
    if choice.measured:
        # A reply long past its own (measured) slow tail is more likely lost (an
        # outage) than late: stop waiting while the local answer is quick to get.
        overdue = now + max(GIVE_UP_AFTER * choice.latency_q_s, FALLBACK_MIN_RESERVE_S)
        give_up = min(give_up, overdue)
    return give_up, local


def _late(bottleneck_s: float, sigma: float, window_s: float) -> float:
    """P(the bottleneck's transfer is not done within ``window_s``) under the rate belief
    (log-normal, spread ``sigma``): P(rate < the rate that is in by then)."""
    if window_s <= 0.0:
        return 1.0
    if window_s == math.inf:
        return 0.0
    if bottleneck_s <= 0.0 or sigma <= 0.0:
        return 0.0 if bottleneck_s <= window_s else 1.0
    return _phi(math.log(bottleneck_s / window_s) / sigma)


def _safe_without_fallback(cloud: Option, deadline_s: float) -> bool:
    """Whether ``cloud``'s tail, well past the deadline quantile, still fits.

    With no room left for a local answer, an offload may break the deadline
    only as rarely as its tail says: the measured spread beyond the mean
    stretched by ``SAFE_TAIL`` (for a normal spread, a 95th percentile to
    beyond four standard deviations: cellular uplinks stall), and the
    bottleneck's transfer time at the slow edge of the rate belief (``SAFE_Z``
    spreads).  A link not yet measured (``MEASURED_SAMPLES`` transfers) is not
    trusted at all: a hedged exploration measures it without risking a request.
    """
    return strict_latency_s(cloud) <= deadline_s


def strict_latency_s(cloud: Option) -> float:
    """A cloud option's latency well into its tail (see :func:`_safe_without_fallback`)."""
    if cloud.strict_s is not None:
        return cloud.strict_s
    if cloud.p_fail > SAFE_P_FAIL or not cloud.measured:
        # Replies get lost here, or the link's tail is not measured yet (a hedge
        # measures it safely): only a fallback makes an offload safe.
        strict = math.inf
    else:
        spread = SAFE_TAIL * (cloud.latency_q_s - cloud.latency_s)
        slow = cloud.bottleneck_s * math.expm1(SAFE_Z * cloud.rate_sigma)
        strict = cloud.latency_s + (spread if spread > slow else slow)
    cloud.strict_s = strict
    return strict


def _fallback_fits(cloud: Option, local: Option, deadline_s: float) -> bool:
    """Whether giving ``cloud`` its predicted time still leaves room to answer locally."""
    reserve = fallback_reserve_s(local)
    return cloud.latency_q_s + reserve <= deadline_s


def exploration_value(o: Option, best_cost: float) -> tuple[float, float]:
    """(P(o beats ``best_cost``), expected saving per request) under o's rate belief.

    The option's cost is affine in ``x = 1/rate`` of its bottleneck
    direction with slope ``o.cost_per_inv_bps``; the belief is log-normal
    around ``o.rate_bps`` with spread ``o.rate_sigma``.  The saving is
    ``E[(best - cost(x))+]``, in closed form (two normal CDFs), so pricing an
    exploration costs about a microsecond.
    """
    slope, sigma = o.cost_per_inv_bps, o.rate_sigma
    if slope <= 0 or sigma <= 0 or o.rate_bps <= 0:
        return 0.0, 0.0
    x_m = 1.0 / o.rate_bps
    x_star = x_m - (o.cost - o.premium - best_cost) / slope  # break-even 1/rate
    if x_star <= 0:
        return 0.0, 0.0  # even an infinitely fast link would not win
    d = math.log(x_star / x_m) / sigma
    p = _phi(d)
    saving = slope * (x_star * p - x_m * math.exp(sigma * sigma / 2) * _phi(d - sigma))
    return p, max(saving, 0.0)


_SQRT_HALF = math.sqrt(0.5)


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z * _SQRT_HALF)


class Policy:
    """Decides where one request runs.  Holds no per-request state."""

    def __init__(
        self,
        config: PolicyConfig,
        estimators: Estimators,
        device: DeviceProfile,
        links: dict[str, LinkProfile],
    ) -> None:
        self.config = config
        self.est = estimators
        self.device = device
        self.links = links  # transport -> the link profile it rides on

    def model_policy(self, model: str) -> ModelPolicy:
        found = self.config.models.get(model)
        if found is not None:
            return found
        return ModelPolicy(local_model=model, cloud_model=model)

    def local_option(self, mp: ModelPolicy, ctx: Context | None = None) -> Option | None:
        """Local run: its own compute time, after the requests queued ahead of it.

        A local model runs one request at a time, so ``ctx.local_backlog``
        requests ahead add their mean each.  A batch size never measured is
        priced as that many batch-1 runs (conservative: batching rarely costs
        more per row).
        """
        if mp.local_model is None:
            return None
        batch = ctx.batch if ctx is not None else 1
        backlog = ctx.local_backlog if ctx is not None else 0
        est = self.est.local_known(mp.local_model, batch)
        scale = 1.0
        if est is None and batch != 1:
            est, scale = self.est.local_known(mp.local_model, 1), float(batch)
        mean = est.mean if est is not None else None
        if mean is None:
            # Never measured: optimistic zero makes the agent try it once and learn.
            return Option(LOCAL, None, 0.0, 0.0, 0.0, 0, 0, 0.0)
        assert est is not None
        q = est.quantile
        if q is None or q < mean:
            q = mean
        mean, q = mean * scale, q * scale
        wait = backlog * mean
        return Option(
            LOCAL, None, wait + mean, wait + q, local_energy_j(self.device, mean), 0, 0, 0.0
        )

    def server_time(self, mp: ModelPolicy) -> tuple[float, float]:
        """(mean, quantile) seconds the cloud takes for ``mp``'s model: queue plus compute."""
        model = mp.cloud_model or ""
        queue = self.est.cloud_queue(model)
        compute = self.est.cloud_compute(model)
        q_mean, c_mean = queue.mean or 0.0, compute.mean or 0.0
        return q_mean + c_mean, (queue.quantile or q_mean) + (compute.quantile or c_mean)

    def cloud_option(
        self,
        mp: ModelPolicy,
        transport: str,
        ctx: Context,
        server: tuple[float, float] | None = None,
        tails: dict[int, tuple[float | None, float | None, float]] | None = None,
    ) -> Option:
        link = self.est.link(transport)
        profile = self.links[transport]
        up, down = ctx.in_bytes, ctx.out_bytes if ctx.out_bytes is not None else mp.output_bytes
        server_s, server_q = server or self.server_time(mp)
        explore = self.config.explore_after_s
        seen, claim = link.bandwidth_update, link.exploring_since
        stale = (
            bool(explore)
            and (seen is None or ctx.now - seen > explore)
            and (claim is None or ctx.now - claim > explore)
        )
        up_bps, up_sigma = link.up_belief.at(link.up_bps, link.prior_up_bps, ctx.now)
        down_bps, down_sigma = link.down_belief.at(link.down_bps, link.prior_down_bps, ctx.now)
        up_low = link.up_bps_low if link.up_bps_low < up_bps else up_bps
        down_low = link.down_bps_low if link.down_bps_low < down_bps else down_bps
        if stale:
            # An old estimate (a bad spell long past) must not keep the option
            # out of a deadline forever: its slow tail is no longer trusted.
            # Its cost stays the mean's; whether to learn more is priced in choose().
            up_low, down_low = up_bps, down_bps
        t_up = up * 8.0 / up_bps
        t_down = down * 8.0 / down_bps
        t_q = up * 8.0 / up_low + down * 8.0 / down_low  # the link's slow tail
        # A radio that went idle (past its tail) must be promoted before it sends.
        idle = ctx.radio_idle_s
        promotion = profile.promotion_s if idle is None or idle >= profile.tail_s else 0.0
        rtt, rtt_q = link.rtt_at(ctx.now)
        latency = promotion + rtt + t_up + t_down + server_s
        latency_q = promotion + rtt_q + t_q + server_q  # rtt_q >= rtt
        # The tail this transfer opens (see transfer_energy_j): until the next request, at
        # the rate requests come, if each used the radio (``tail``); until the next one
        # that does, at the share that recently did.  From a radio still up,
        # what this offload pays is less the part of the running tail that would burn
        # anyway if it ran locally (``extra``: see :func:`tail_extension_s`), and
        # ``shared`` what it would pay less if the next request used the radio, as every
        # one would.  Links that share a profile share all of these within a decision.
        key = id(profile)
        if tails is not None and key in tails:
            tail, extra, shared = tails[key]
        else:
            rate, share = ctx.rate_per_s, ctx.radio_share
            tail = extra = None
            shared = 0.0
            if rate:
                tail = expected_tail_s(profile, rate)
                extra = tail_extension_s(profile, rate, tail, ctx.radio_idle_s)
                if share is not None and share < 1.0:
                    alike, used = tail, rate * share  # a run: each pays its whole share
                    extra = tail_extension_s(
                        profile, used, expected_tail_s(profile, used), ctx.radio_idle_s
                    )
                    if extra > alike:
                        shared = extra - alike  # both <= tail_s
            if tails is not None:
                tails[key] = (tail, extra, shared)
        energy = transfer_energy_j(
            profile,
            up,
            down,
            up_bps,
            down_bps,
            server_s + rtt,
            self.device,
            ctx.radio_idle_s,
            extra,
        )
        money = (up + down) / 1e6 * profile.cost_per_mb if profile.metered else 0.0
        # Cost is affine in the bottleneck's transfer time: latency, the radio's
        # base power and the device's idle power for as long as the bytes take.
        w = self.config.weights
        per_s = w.latency_s + w.energy_j * (profile.base_power_w + self.device.idle_power_w)
        warm_cost = None
        shared_j = profile.tail_power_w * shared  # what the next request takes over
        if promotion > 0 and tail is not None:
            # The same offload from a radio already up: no promotion (its time and power),
            # and in a warm run the next request shares its tail.
            saved_j = (profile.promotion_power_w + self.device.idle_power_w) * promotion
            saved_j += shared_j
            warm_cost = (
                w.latency_s * (latency - promotion)
                + w.energy_j * (energy - saved_j)
                + w.data_mb * (up + down) / 1e6
                + w.money * money
            )
        if t_up >= t_down:  # the bottleneck: the direction that takes longer
            nbits, rate, sigma = up * 8.0, up_bps, up_sigma
        else:
            nbits, rate, sigma = down * 8.0, down_bps, down_sigma
        return Option(  # (by position: see Option)
            _CLOUD_NAMES.get(transport) or f"cloud-{transport}",
            transport,
            latency,
            latency_q,
            energy,
            up,
            down,
            money,
            stale,
            promotion,
            nbits * per_s,  # cost_per_inv_bps
            rate,
            sigma,
            nbits / rate if rate > 0 else 0.0,  # bottleneck_s
            link.failure_rate(ctx.now),  # p_fail
            warm_cost,
            w.energy_j * shared_j,  # shared_saving
            tail,
            link.samples >= MEASURED_SAMPLES and not stale,  # measured
            # run_extra: the forward tail share a warm run pays, less this one's extension
            w.energy_j * profile.tail_power_w * (tail - extra)
            if tail is not None and extra is not None and promotion == 0.0 and tail > extra
            else 0.0,
            # run_per_byte: time while the upload is the bottleneck, the radio's power
            # per bit, and the bytes' own price (data weight, a metered link's money)
            (8.0 * per_s / up_bps if t_up >= t_down else 0.0)
            + w.energy_j * profile.alpha_up_w_per_mbps * 8e-6
            + (w.data_mb + (w.money * profile.cost_per_mb if profile.metered else 0.0)) / 1e6,
        )

    def decide(self, model: str, ctx: Context, mode: str | None = None) -> Decision:
        return self.decide_for(self.model_policy(model), ctx, mode)

    def decide_for(self, mp: ModelPolicy, ctx: Context, mode: str | None = None) -> Decision:
        """The decision for a request under ``mp`` (the model's policy as the request sees it)."""
        mode = mode or mp.mode
        options: list[Option] = []
        if mode != "cloud":
            local = self.local_option(mp, ctx)
            if local is not None:
                options.append(local)
        if mode != "local" and mp.cloud_model is not None:
            server = self.server_time(mp)
            tails: dict[int, tuple[float | None, float | None, float]] = {}
            for transport in mp.transports:
                if transport in self.links:
                    options.append(self.cloud_option(mp, transport, ctx, server, tails))
        decision = self.choose(options, ctx)
        if (
            mode == mp.mode
            and mode in ("local", "cloud")
            and decision.reason in (LEAST_COST, LOW_BATTERY)
        ):
            # (the mode decided, not the prices: "least energy" had named a cloud run
            # that cost more energy than the local one)
            decision.reason = f"mode {mode}"
        return decision

    def choose(self, options: list[Option], ctx: Context) -> Decision:
        cfg = self.config
        w = cfg.weights
        low_battery = (
            ctx.battery_percent is not None and ctx.battery_percent < cfg.battery_floor_percent
        )
        cap = cfg.data_cap_mb_per_day
        w_lat, w_j, w_mb, w_money = w.latency_s, w.energy_j, w.data_mb, w.money
        best: Option | None = None
        # A local run that makes the deadline is a promise: no offload may break it.
        # (decide_for lists the local option first, when there is one.)
        local = options[0] if options and options[0].transport is None else None
        if local is not None and local.latency_q_s > ctx.deadline_s:
            local = None
        due = 0.0  # when a race's local run must start (the same for every offload)
        if local is not None:
            due = ctx.deadline_s - fallback_reserve_s(local)
        for o in options:
            if o.transport is not None:
                if not ctx.connected.get(o.transport, False):
                    o.feasible, o.reason = False, "no link"
                elif (
                    cap is not None
                    and ctx.data_used_mb_today + (o.up_bytes + o.down_bytes) / 1e6 > cap
                ):
                    o.feasible, o.reason = False, "data cap"
            if o.feasible and o.latency_q_s > ctx.deadline_s:
                o.feasible, o.reason = False, "deadline"
            elif o.feasible and local is not None and o.transport is not None:
                if due > 0.0 and not low_battery:
                    o.race_s = race_start_s(o, due)
                elif not _safe_without_fallback(o, ctx.deadline_s) and not _fallback_fits(
                    o, local, ctx.deadline_s
                ):
                    o.feasible, o.reason = False, NO_ROOM
            if low_battery:
                o.cost = o.energy_j
            else:
                o.cost = (
                    w_lat * o.latency_s
                    + w_j * o.energy_j
                    + w_mb * (o.up_bytes + o.down_bytes) / 1e6
                    + w_money * o.money
                )
                if o.run_extra and local is not None:
                    # Is a run of offloads dearer than running locally?  Priced one at a
                    # time from a radio up, an offload pays only the tail it adds: the
                    # radio stays up on a link where every request offloaded costs more,
                    # a typical one priced (not this one: a large request must not end a
                    # run that pays, nor a small one keep one that does not).
                    typical = o.cost + o.run_extra
                    if ctx.mean_in_bytes is not None and o.run_per_byte:
                        typical += (ctx.mean_in_bytes - o.up_bytes) * o.run_per_byte
                    if typical > local.cost:
                        o.cost += o.run_extra
                if o.race_s is not None:
                    assert local is not None
                    beat = best.cost if best is not None else math.inf
                    self._race(o, local, ctx, beat)
                    if o.feasible and (best is None or o.cost < best.cost):
                        best = o
                    continue
                if o.p_fail and local is not None:
                    # A lost reply costs the wait until giving up, then the local run.
                    o.cost += o.p_fail * (w_lat * o.latency_q_s + local.cost)
            if o.feasible and (best is None or o.cost < best.cost):
                best = o
        if best is not None:
            if not low_battery and best.transport is None:
                warm_up = self._warm_up(options, best, ctx)
                if warm_up is not None:
                    return warm_up
            if not low_battery and cfg.explore_after_s > 0:
                explore = self._exploration(options, best, ctx)
                if explore is not None:
                    return explore
            reason = LOW_BATTERY if low_battery else LEAST_COST
            capped = [o.name for o in options if o.reason == "data cap"]
            if capped and best.transport is None:  # (the cap, not the prices, kept it local)
                reason = f"{reason} ({', '.join(capped)}: data cap)"
            return Decision(best, options, reason)
        # Nothing meets every constraint: keep the deadline soft, never the link or the cap.
        usable = [o for o in options if o.reason == "deadline"]
        if usable:
            fallback = min(usable, key=lambda o: o.latency_q_s)
            if fallback.transport is None and not low_battery and cfg.explore_after_s > 0:
                late = self._late_exploration(usable, fallback, ctx)
                if late is not None:
                    return Decision(late, options, explore_late_reason(late), True, True)
            return Decision(fallback, options, "no option meets the deadline: fastest")
        return Decision(None, options, "no usable option")

    def _late_exploration(self, usable: list[Option], local: Option, ctx: Context) -> Option | None:
        """An offload to try beside the local run when every option misses the deadline.

        A link never measured is priced by its prior, which a tight deadline may rule
        out for good: every request ran locally and missed (a 150 ms deadline, a 200 ms
        device, a WiFi link answering in 10 ms).  The request is late anyway, so one
        doubtful link is tried at once beside the local run (the first answer wins),
        one request per ``explore_after_s``, and what it teaches decides the next."""
        pick: Option | None = None
        for o in usable:
            if o.transport is None or o.rate_sigma < 0.05:
                continue  # (a link it knows well: its prices stand)
            fast = o.latency_s - o.bottleneck_s * (1.0 - math.exp(-LATE_EXPLORE_Z * o.rate_sigma))
            if fast >= local.latency_s:
                # even at a rate the belief puts far above its mean it cannot beat the
                # local run: trying it teaches nothing (a 5 s link, tried every 10 s as
                # its belief widened with age, spent 434 MB an hour)
                continue
            claim = self.est.link(o.transport).exploring_since
            if claim is not None and ctx.now - claim < self.config.explore_after_s:
                continue
            if pick is None or o.latency_s < pick.latency_s:
                pick = o
        if pick is not None:
            assert pick.transport is not None
            self.est.link(pick.transport).exploring_since = ctx.now
        return pick

    def _warm_up(self, options: list[Option], best: Option, ctx: Context) -> Decision | None:
        """Offload from an idle radio when the warm run it starts pays for the wake-up.

        Priced one request at a time, a cellular radio's promotion and tail
        make every offload from idle dearer than running locally, even where
        offloading every request would be cheaper: after the first, each
        finds the radio up.  So an offload from idle is taken when the
        expected saving of the requests that follow within the tail (each
        saving ``best - warm_cost``), over the expected length of that run
        at the current request rate, exceeds its extra cost now.

        The same holds for a radio still up while most recent requests ran
        locally: an offload now pays the rest of the tail alone (the recent
        share prices it so), and running locally lets the radio go idle, after
        which only a wake-up brings the warm run back.  Priced per request,
        local stays the cheaper choice for good, even where a run of offloads,
        each sharing the tail with the next, costs less than a run of local
        answers.  So the radio is kept up when that run pays for this
        request's lone tail: its warm cost is its cost less the tail the next
        request would take over (``shared_saving``).
        """
        rate = ctx.rate_per_s
        if not rate:
            return None
        pick: tuple[float, Option, float, bool] | None = None
        for o in options:
            if o.transport is None:
                continue
            warm_cost = o.warm_cost
            if warm_cost is None:  # the radio is up (no promotion)
                if o.shared_saving <= 0.0:
                    continue
                warm_cost = o.cost - o.shared_saving
            # Too late only for the promotion: the wake-up goes beside the local run,
            # which answers this request; the ones after it find the radio up.
            beside = late_only_for_promotion(o, ctx.deadline_s)
            if not o.feasible and o.reason != NO_ROOM and not beside:
                continue
            saving = best.cost - warm_cost
            if saving <= 0:
                continue
            # The warm run's saving at the pessimistic edge of the rate belief: a
            # wake-up is a bet on the link, made only when it pays even then.
            if o.rate_bps:
                saving -= o.cost_per_inv_bps / o.rate_bps * math.expm1(o.rate_sigma)
                if saving <= 0:
                    continue
            # P(the next request comes within the tail) = rate * E[min(gap, tail)].
            tail = (
                o.tail_s if o.tail_s is not None else expected_tail_s(self.links[o.transport], rate)
            )
            p_next = rate * tail if rate * tail < 1.0 else 1.0
            gap = 1.0 - p_next
            run = p_next / gap if gap > 1e-9 else 1e9
            horizon = horizon_requests(rate)
            if horizon < run:
                run = horizon
            price, hedge = o.cost - best.cost, False
            # Hedged, running locally meanwhile, where that is cheaper (energy that costs
            # little), or where there is no room to fall back after it, unless racing
            # the local run (o.cost prices that) is cheaper.
            hedged = self._hedge_price(o, best, best, ctx.local_cancellable)
            if hedged < price:
                price, hedge = hedged, True
            elif beside or not _fallback_fits(o, best, ctx.deadline_s):  # best: local
                if beside or o.race_s is None:
                    price, hedge = hedged, True
            if saving * run <= price:
                continue
            if pick is None or saving * run - price > pick[0]:
                pick = (saving * run - price, o, price, hedge)
        if pick is None:
            return None
        gain, o, price, hedge = pick
        # (a hedged wake-up may cost less than the best option itself: say so plainly)
        if price > 1e-9:
            now = f"it costs {price:.4g} now"
        elif price < -1e-9:
            now = f"it is {-price:.4g} cheaper than the best option now"
        else:
            now = "it costs nothing now"
        why = (
            f"{'keep the radio up' if o.promotion_s == 0.0 else 'wake the radio'}"
            f"{' (hedged)' if hedge else ''}: the warm run after it saves "
            f"{gain + price:.4g}; {now}"
        )
        return Decision(o, options, why, hedge)

    def _exploration(self, options: list[Option], best: Option, ctx: Context) -> Decision | None:
        """An offload worth making for what it teaches, if any (see :func:`exploration_value`).

        Only an option that could beat the best one, whose expected saving
        over the requests that would use the knowledge exceeds its price
        now, and whose attempt still leaves time to answer locally.
        """
        local = options[0] if options and options[0].transport is None else None
        if local is not None and not local.feasible:
            local = None
        horizon = horizon_requests(ctx.rate_per_s)
        pick: tuple[float, Option, float, float, bool] | None = None
        for o in options:
            if o is best or o.transport is None or o.rate_sigma < 0.05:
                continue
            if not o.feasible and o.reason != NO_ROOM:
                continue  # only an offload that lacks room to fall back may still be hedged
            claim = self.est.link(o.transport).exploring_since
            if claim is not None and ctx.now - claim < self.config.explore_after_s:
                continue  # one exploring request at a time
            price = o.cost - best.cost
            # what the offloads it leads to would pay
            future = o.cost - _run_discount(o, ctx.rate_per_s, self.config.weights.latency_s)
            # Even an infinitely fast link saves at most this per request: if that
            # cannot repay the price, the belief's details do not matter.
            if o.rate_bps > 0:
                ceiling = best.cost - future + o.premium + o.cost_per_inv_bps / o.rate_bps
                if ceiling * horizon <= price:
                    continue
            p_better, saving = exploration_value(o, best.cost + o.cost - future)
            value = saving * horizon
            hedge = False
            if local is not None:  # feasible: its run makes the deadline
                # Exploring must not cost this request its deadline: with no room to
                # fall back afterwards, the local run goes at once, beside the attempt;
                # and where a hedge is the cheaper way to learn (a doubtful link that
                # may crawl past the time to give up on it), it is taken too.
                hedged = self._hedge_price(o, local, best, ctx.local_cancellable)
                room = _fallback_fits(o, local, ctx.deadline_s)
                if room and o.race_s is None:
                    price = self._plain_price(o, local, best, ctx.deadline_s)
                if hedged < price or not (room or o.race_s is not None):
                    price, hedge = hedged, True
            if value <= price:
                continue
            if pick is None or value - price > pick[0]:
                pick = (value - price, o, p_better, price, hedge)
        if pick is None:
            return None
        _, o, p_better, price, hedge = pick
        assert o.transport is not None
        self.est.link(o.transport).exploring_since = ctx.now
        why = (
            f"explore{' (hedged)' if hedge else ''}: P(better) {p_better:.2f}, expected saving "
            f"{pick[0] + price:.4g} over {horizon:.0f} requests > price {price:.4g}"
        )
        return Decision(o, options, why, hedge, True)

    def _race(self, o: Option, local: Option, ctx: Context, beat: float = math.inf) -> None:
        """Price ``o`` as a race against the local run (``o.race_s`` set); set its cost.

        With a local run that makes the deadline, that run is the promise: it
        starts at ``o.race_s``, the latest moment that still makes the
        deadline, unless the cloud has answered by then, and the first answer
        wins; the offload is never abandoned for it (a late reply that comes
        first still answers).  Ruling out an offload whose tail is not trusted
        leaves a lossy link's every fast reply unused, and giving up on a reply
        at the local run's start wastes the upload.  So the race costs the
        cloud's answer when it is in time (P from the rate belief), the local
        run's energy beside a reply that comes near its tail when it is late,
        and the local answer after the wait when the reply is lost (the link's
        losses); the radio stays on while the attempt goes on.  A local
        run that can be cancelled stops when the late reply comes: it costs
        only its part until then.

        Starting the local run with the offload instead (``race_s`` 0) pays the
        local run until the first answer, every time, and never waits out a
        lost or slow reply: the cheaper start where energy costs little and
        replies go missing.  It also holds the local runtime meanwhile: the
        requests that come then (at the model's rate) wait for it where their
        own local run is what answers them.  Both starts are priced and the
        cheaper kept; ``beat`` (the best option's cost so far) spares the
        second pricing where it cannot win.
        """
        w = self.config.weights
        w_lat = w.latency_s
        deadline_s, cancellable = ctx.deadline_s, ctx.local_cancellable
        due = o.race_s if o.race_s is not None else 0.0
        base = o.cost  # the cloud's cost at the belief's median, its losses not yet priced
        lat, bottleneck, sigma = o.latency_s, o.bottleneck_s, o.rate_sigma
        run = local.latency_s
        p_late = _late(bottleneck, sigma, due - (lat - bottleneck))
        radio_w = 0.0  # cost per second of keeping the radio on
        if bottleneck > 0.0 and o.rate_bps > 0.0:
            per_s = o.cost_per_inv_bps / (bottleneck * o.rate_bps)
            if per_s > w_lat:
                radio_w = per_s - w_lat
        local_j = w.energy_j * local.energy_j
        answer_by = due + run  # the local answer, if nothing came before
        cost = base
        if p_late > 0.0:
            tail = o.latency_q_s if o.latency_q_s > due else due
            slow = tail if tail < answer_by else answer_by
            ran_j = local_j
            if cancellable and run > 0.0:
                ran_j *= (slow - due) / run  # slow <= answer_by: at most all of it
            cost += p_late * ((w_lat + radio_w) * (slow - lat) + ran_j)
        p_fail = o.p_fail
        on = 0.0  # the radio kept on until giving up on a lost reply
        if p_fail > 0.0:
            on = radio_w * (deadline_s - lat) if deadline_s > lat else 0.0
            lost = base + w_lat * (answer_by - lat) + local_j + on
            cost += p_fail * (lost - cost)
        # Or the local run starts with the offload (see the docstring); the least it
        # can cost says whether it could beat this start or ``beat`` (another option).
        if run < lat:
            floor = base + w_lat * (run - lat) + local_j
        else:
            floor = base + local_j * lat / run if cancellable else base + local_j
        if floor < cost and floor < beat and due > 0.0:
            p_over = _late(bottleneck, sigma, run - (lat - bottleneck))  # after local's
            answer = lat + p_over * (run - lat)  # the earlier of the two, roughly
            ran_j = local_j
            if cancellable and run > answer:
                ran_j *= answer / run
            both = base + w_lat * (answer - lat) + ran_j
            rate = ctx.rate_per_s
            if rate:
                # A request that comes while it runs waits for the runtime, which
                # matters where its own local run answers it (as this one's may)
                busy = answer if cancellable else run
                need = p_over + p_fail if p_over + p_fail < 1.0 else 1.0
                both += w_lat * rate * busy * busy * 0.5 * need
            if p_over > 0.0 and o.latency_q_s > lat:
                both += p_over * radio_w * (o.latency_q_s - lat)  # the reply still comes
            if p_fail > 0.0:
                lost = base + w_lat * (run - lat) + local_j + on
                both += p_fail * (lost - both)
            if both < cost:
                cost, o.race_s = both, 0.0
        o.cost = cost
        o.premium = cost - base  # what the race costs beyond the median (exploration)

    def _plain_price(self, o: Option, local: Option, best: Option, deadline_s: float) -> float:
        """What offloading ``o`` alone costs beyond ``best``, its crawl risk included.

        Under the rate belief the bottleneck may be too slow to finish before
        the agent gives up (the deadline less the local reserve); then the
        request pays that wait, the local run, and the offload's energy and
        bytes.  ``o.cost`` alone prices only the mean.
        """
        reserve = fallback_reserve_s(local)
        window = deadline_s - reserve - (o.latency_s - o.bottleneck_s)
        slow_cost = (
            self.config.weights.latency_s * (deadline_s - reserve)
            + local.cost
            + o.cost
            - self.config.weights.latency_s * o.latency_s
        )
        if o.bottleneck_s <= 0 or o.rate_sigma <= 0:
            p_slow = 0.0
        elif window <= 0:
            p_slow = 1.0
        else:  # P(rate < the rate that finishes within the window)
            p_slow = _phi(math.log(o.bottleneck_s / window) / o.rate_sigma)
        return (1.0 - p_slow) * o.cost + p_slow * slow_cost - best.cost

    def _hedge_price(
        self, o: Option, local: Option, best: Option, cancellable: bool = False
    ) -> float:
        """What running ``local`` and offloading ``o`` at once costs beyond ``best``.

        The answer comes from whichever finishes first, so its latency is at
        most the local run's: the hedge costs the local run plus everything of
        the offload but its latency (radio energy, bytes, money).
        """
        base = o.cost - o.premium
        w = self.config.weights
        price = local.cost + base - w.latency_s * o.latency_s - best.cost
        if cancellable and o.latency_s < local.latency_s:
            # The reply usually comes first and stops the local run there.
            price -= w.energy_j * local.energy_j * (1.0 - o.latency_s / local.latency_s)
        return price

    def cascade_offload(self, model: str, confidence: float) -> bool:
        """Sedna-style joint inference: offload when the local top-1 is unsure."""
        return confidence < self.model_policy(model).cascade_threshold
