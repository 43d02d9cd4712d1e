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

from dataclasses import dataclass, field

from devices.profiles import DeviceProfile, LinkProfile
from edge.core.energy import local_energy_j, transfer_energy_j
from edge.core.estimators import Estimators

LOCAL = "local"
MODES = ("cost", "cascade", "local", "cloud")
TRANSPORTS = ("mqtt", "http")


@dataclass(frozen=True)
class Weights:
    """Cost per unit: a second of latency, a joule, a megabyte, a unit of money."""

    latency_s: float = 1.0
    energy_j: float = 0.0
    data_mb: float = 0.0
    money: float = 0.0


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


@dataclass(frozen=True)
class PolicyConfig:
    weights: Weights = field(default_factory=Weights)
    deadline_quantile: float = 0.95
    battery_floor_percent: float = 15.0
    data_cap_mb_per_day: float | None = None
    default_deadline_ms: float = 1000.0
    # A link estimate older than this is refreshed by routing one request that
    # can afford it through that link (0: never explore).  Without it, an agent
    # that stays local never learns that the link got better.
    explore_after_s: float = 10.0
    models: dict[str, ModelPolicy] = field(default_factory=dict)


@dataclass(slots=True)
class Option:
    name: str  # "local", "cloud-mqtt", "cloud-http"
    transport: str | None
    latency_s: float
    latency_q_s: float
    energy_j: float
    up_bytes: int
    down_bytes: int
    money: float
    cost: float = 0.0
    feasible: bool = True
    reason: str = ""
    stale: bool = False
    promotion_s: float = 0.0  # radio promotion included in the latency (cloud options)


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


@dataclass(slots=True)
class Decision:
    choice: Option | None
    options: list[Option]
    reason: str = ""

    @property
    def where(self) -> str:
        return self.choice.name if self.choice else "none"


# Time kept back from the cloud for a local answer, as a multiple of the local
# latency quantile (room for the local run's own jitter), and at least enough
# to get the fallback scheduled at all.
FALLBACK_RESERVE = 1.5
FALLBACK_MIN_RESERVE_S = 0.02


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
    reserve = max(local.latency_q_s * FALLBACK_RESERVE, FALLBACK_MIN_RESERVE_S)
    if reserve >= deadline - now:
        return deadline, local
    return min(max(deadline - reserve, now + choice.latency_q_s), deadline), local


def _fallback_fits(cloud: Option, local: Option, deadline_s: float) -> bool:
    """Whether giving ``cloud`` its predicted time still leaves room to answer locally."""
    reserve = max(local.latency_q_s * FALLBACK_RESERVE, FALLBACK_MIN_RESERVE_S)
    return cloud.latency_q_s + reserve <= deadline_s


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

    def cloud_option(self, mp: ModelPolicy, transport: str, ctx: Context) -> Option:
        link = self.est.link(transport)
        profile = self.links[transport]
        up, down = ctx.in_bytes, ctx.out_bytes if ctx.out_bytes is not None else mp.output_bytes
        model = mp.cloud_model or ""
        queue = self.est.cloud_queue(model)
        compute = self.est.cloud_compute(model)
        server = (queue.mean or 0.0) + (compute.mean or 0.0)
        server_q = (queue.quantile or queue.mean or 0.0) + (compute.quantile or compute.mean or 0.0)
        explore = self.config.explore_after_s
        seen, claim = link.bandwidth_update, link.exploring_since
        stale = (
            bool(explore)
            and (seen is None or ctx.now - seen > explore)
            and (claim is None or ctx.now - claim > explore)
        )
        up_bps, down_bps = link.up_bps, link.down_bps
        up_low, down_low = link.up_bps_low, link.down_bps_low
        if stale:
            # Optimism under uncertainty: an old estimate (a bad spell long
            # past) must not keep the option infeasible forever.
            up_bps, down_bps = max(up_bps, link.prior_up_bps), max(down_bps, link.prior_down_bps)
            up_low, down_low = up_bps, down_bps
        t_up = up * 8.0 / up_bps
        t_down = down * 8.0 / down_bps
        t_q = up * 8.0 / up_low + down * 8.0 / down_low  # the link's slow tail
        # A radio that went idle (past its tail) must be promoted before it sends.
        idle = ctx.radio_idle_s
        promotion = profile.promotion_s if idle is None or idle >= profile.tail_s else 0.0
        latency = promotion + link.rtt_s + t_up + t_down + server
        latency_q = promotion + max(link.rtt_quantile, link.rtt_s) + t_q + server_q
        energy = transfer_energy_j(
            profile,
            up,
            down,
            up_bps,
            down_bps,
            server + link.rtt_s,
            self.device,
            ctx.radio_idle_s,
        )
        money = (up + down) / 1e6 * profile.cost_per_mb if profile.metered else 0.0
        return Option(
            f"cloud-{transport}",
            transport,
            latency,
            latency_q,
            energy,
            up,
            down,
            money,
            stale=stale,
            promotion_s=promotion,
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
        if mode not in ("local",) and mp.cloud_model is not None:
            for transport in mp.transports:
                if transport in self.links:
                    options.append(self.cloud_option(mp, transport, ctx))
        return self.choose(options, ctx)

    def choose(self, options: list[Option], ctx: Context) -> Decision:
        cfg = self.config
        w = cfg.weights
        low_battery = (
            ctx.battery_percent is not None and ctx.battery_percent < cfg.battery_floor_percent
        )
        cap = cfg.data_cap_mb_per_day
        best: Option | None = None
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
            if low_battery:
                o.cost = o.energy_j
            else:
                o.cost = (
                    w.latency_s * o.latency_s
                    + w.energy_j * o.energy_j
                    + w.data_mb * (o.up_bytes + o.down_bytes) / 1e6
                    + w.money * o.money
                )
            if o.feasible and (best is None or o.cost < best.cost):
                best = o
        if best is not None:
            if not low_battery:
                local = next((o for o in options if o.transport is None and o.feasible), None)
                for o in options:
                    if o.stale and o.feasible and o is not best and o.transport is not None:
                        if local is not None and not _fallback_fits(o, local, ctx.deadline_s):
                            continue  # exploring must not cost this request its deadline
                        self.est.link(o.transport).exploring_since = ctx.now
                        return Decision(o, options, "explore: link estimate is stale")
            return Decision(
                best, options, "low battery: least energy" if low_battery else "least cost"
            )
        # Nothing meets every constraint: keep the deadline soft, never the link or the cap.
        usable = [o for o in options if o.reason == "deadline"]
        if usable:
            fallback = min(usable, key=lambda o: o.latency_q_s)
            return Decision(fallback, options, "no option meets the deadline: fastest")
        return Decision(None, options, "no usable option")

    def cascade_offload(self, model: str, confidence: float) -> bool:
        """Sedna-style joint inference: offload when the local top-1 is unsure."""
        return confidence < self.model_policy(model).cascade_threshold
