"""What a request really costs in a replay: the simulated link, radio and compute.

Every policy in a replay (ours, the baselines, the oracle) is judged by this
one model, so a difference in cost is a difference in decisions.

Link.  An uplink and a downlink trace give the capacity over time (mahimahi
delivery opportunities).  An offloaded request's bytes enter the uplink
bottleneck when the radio is ready, take the trace's opportunities from
then on, and reach the server half an RTT after the last one; the reply
leaves after the server time, travels half an RTT and crosses the downlink
bottleneck the same way.  **Requests are independent**: each transfer gets
the trace's whole capacity from its own start, as if it were alone on the
link.  Real requests that overlap share the bottleneck, so where they
overlap this model is optimistic for offloading (every policy alike); the
report gives the share of offloaded requests that overlapped another
transfer, so a reader can see how much that matters for a workload.  Local
runs are independent in the same way (no queue on the device).  The reason
is the oracle: with independent requests, the only thing that couples them
is the one radio, so the cheapest schedule follows from a dynamic programme
over the radio's state (``baselines.run_oracle``), a true lower bound.

Radio.  The LTE/3G/WiFi radio model of :mod:`edge.core.energy` (Huang et al.,
MobiSys 2012), with the radio state tracked per replay by
:class:`edge.core.energy.RadioState`: a transfer that starts while the radio is
idle (never used, or past its tail) waits ``promotion_s`` and pays the
promotion and a full tail; one that starts within the tail of the previous
transfer (or during it) starts at once and only extends the tail.  The
radio is on from the end of the promotion until the reply is in, or until
the agent gives up: an abandoned attempt is charged for the time the radio
was on and for the bytes that crossed the link by then, read off the trace.

Compute.  Local and cloud times are drawn from profiles measured on real
runtimes; each request's draws are fixed up front and shared by every
policy, so all of them face the same "luck".

Cost = the policy file's weighted sum (latency, energy, data, money) plus
``miss_penalty`` for a request answered late or not at all.  A request that
fails early (an error before its deadline) is charged its whole deadline of
latency: an error is never cheaper than a late answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from devices.profiles import DeviceProfile, LinkProfile
from edge.core.energy import RadioState, local_energy_j, transfer_energy_j
from edge.core.policy import LOCAL, Weights
from edge.evaluation.workload import Requests
from edge.netem.traces import Trace

#: Bytes each way of the agent's link probe (a small publish or a health GET).
PROBE_BYTES = 200
#: The agent gives a probe this long before it counts as failed.
PROBE_TIMEOUT_S = 2.0
#: An answer this close to its deadline is on time (float noise).
EPS = 1e-9


@dataclass(frozen=True)
class ComputeProfile:
    """Measured latency samples (seconds) and local top-1 confidences."""

    local_s: tuple[float, ...]
    cloud_s: tuple[float, ...]
    confidences: tuple[float, ...] = ()
    local_speed_factor: float = 1.0  # device slowdown applied to local samples
    # The local model's runtime takes a cancel (ONNX Runtime, OpenVINO; not LiteRT):
    # the agent then stops a race's local run when the cloud answers first.
    local_cancellable: bool = False


@dataclass
class Outcome:
    """How one request was answered, and what it cost (the bytes are those that crossed)."""

    where: str  # "local", "cloud-mqtt", "cloud-http", or "none" (no answer)
    latency_s: float  # arrival to answer (a result or an error)
    energy_j: float
    up_bytes: int
    down_bytes: int
    money: float
    missed: bool  # answered after the deadline, or with an error
    deadline_s: float = math.inf
    fallback: bool = False  # the cloud was tried first and given up on
    radio: tuple[float, float] | None = None  # when this request's radio was on
    probes: int = 0  # link probes since the previous request (their cost is in here)
    probe_energy_j: float = 0.0  # the part of ``energy_j`` those probes took


@dataclass
class Result:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Attempt:
    """One offload attempt: what the link did with it."""

    delivered: bool
    start: float  # the radio is ready (after a promotion, if one was needed)
    end: float  # the reply is in, or the agent gave up
    up_bytes: int  # bytes that crossed the uplink by ``end``
    down_bytes: int
    energy_j: float
    money: float
    server_s: float


class Simulator:
    """The ground truth a replay is judged by (see the module doc)."""

    def __init__(
        self,
        *,
        up: Trace,
        down: Trace,
        link: LinkProfile,
        device: DeviceProfile,
        profile: ComputeProfile,
        weights: Weights,
        requests: Requests,
        output_bytes: int,
        miss_penalty: float,
        seed: int,
    ) -> None:
        if not profile.local_s or not profile.cloud_s:
            raise ValueError("a compute profile needs local and cloud samples")
        self.up, self.down, self.link, self.device = up, down, link, device
        self.profile, self.weights, self.requests = profile, weights, requests
        self.output_bytes = output_bytes
        self.miss_penalty = miss_penalty
        self.rtt_s = link.rtt_ms / 1000.0
        n = len(requests)
        rng = np.random.default_rng([seed, 3])
        local = np.asarray(profile.local_s) * profile.local_speed_factor
        cloud = np.asarray(profile.cloud_s)
        conf = np.asarray(profile.confidences or (1.0,))
        self.local_s = local[rng.integers(len(local), size=n)]
        self.server_s = cloud[rng.integers(len(cloud), size=n)]
        self.confidence = conf[rng.integers(len(conf), size=n)]

    # -- local --------------------------------------------------------------------

    def local(self, i: int, begin_s: float = 0.0) -> Outcome:
        """Request ``i`` run locally, starting ``begin_s`` after its arrival."""
        compute = float(self.local_s[i])
        latency = begin_s + compute
        deadline = float(self.requests.deadlines_s[i])
        return Outcome(
            LOCAL,
            latency,
            local_energy_j(self.device, compute),
            0,
            0,
            0.0,
            latency > deadline + EPS,
            deadline,
        )

    # -- the link -----------------------------------------------------------------

    def promotion_s(self, radio_idle_s: float | None) -> float:
        idle = radio_idle_s is None or radio_idle_s >= self.link.tail_s
        return self.link.promotion_s if idle else 0.0

    def attempt(
        self,
        t: float,
        in_bytes: int,
        out_bytes: int,
        server_s: float,
        give_up_at: float,
        radio_idle_s: float | None,
    ) -> Attempt:
        """A round trip offered at ``t``; the sender stops waiting at ``give_up_at``."""
        half = self.rtt_s / 2
        start = t + self.promotion_s(radio_idle_s)
        up_end = self.up.finish_time(start, in_bytes)
        down_start = up_end + half + server_s + half
        down_end = self.down.finish_time(down_start, out_bytes) if up_end < math.inf else math.inf
        delivered = math.isfinite(down_end) and down_end <= give_up_at + EPS
        end = down_end if delivered else max(give_up_at, t)
        if delivered:
            sent, received = in_bytes, out_bytes
        else:
            sent = in_bytes if up_end <= end else min(in_bytes, self.up.bytes_between(start, end))
            received = (
                min(out_bytes, self.down.bytes_between(down_start, end)) if down_start < end else 0
            )
        # The radio is on from ``start`` to ``end``: moving bytes for as long as each
        # bottleneck held them, waiting (RTT, server) the rest of the time.
        on = max(end - start, 0.0)
        t_up = max(min(up_end, end) - start, 0.0) if sent else 0.0
        t_down = max(min(down_end, end) - down_start, 0.0) if received else 0.0
        energy = transfer_energy_j(
            self.link,
            sent,
            received,
            sent * 8 / max(t_up, 1e-9),
            received * 8 / max(t_down, 1e-9),
            max(on - t_up - t_down, 0.0),
            self.device,
            radio_idle_s,
        )
        money = (sent + received) / 1e6 * self.link.cost_per_mb if self.link.metered else 0.0
        return Attempt(delivered, start, end, sent, received, energy, money, server_s)

    def offload(
        self, i: int, t: float, give_up_at: float, radio: RadioState, in_bytes: int | None = None
    ) -> Attempt:
        """Request ``i``'s payload sent at ``t`` through the radio ``radio`` (updated)."""
        size = int(self.requests.in_bytes[i]) if in_bytes is None else in_bytes
        a = self.attempt(
            t, size, self.output_bytes, float(self.server_s[i]), give_up_at, radio.radio_idle_s(t)
        )
        radio.transfer_done(a.end)
        return a

    def probe(self, t: float, radio: RadioState) -> Attempt:
        """The agent's light round trip (no server time), abandoned after PROBE_TIMEOUT_S."""
        a = self.attempt(
            t, PROBE_BYTES, PROBE_BYTES, 0.0, t + PROBE_TIMEOUT_S, radio.radio_idle_s(t)
        )
        radio.transfer_done(a.end)
        return a

    def cloud_outcome(self, i: int, t: float, a: Attempt, where: str) -> Outcome:
        """A cloud answer (delivered) or the error the caller gets when it gives up
        (no answer: "none", so an attempt that never came back is not counted as
        offloaded in the report, as ours' fallbacks are not)."""
        deadline = float(self.requests.deadlines_s[i])
        latency = a.end - float(self.requests.arrivals[i])
        return Outcome(
            where if a.delivered else "none",
            latency,
            a.energy_j,
            a.up_bytes,
            a.down_bytes,
            a.money,
            not a.delivered or latency > deadline + EPS,
            deadline,
            radio=(a.start, a.end),
        )

    def expected_cloud(
        self, in_bytes: float, up_bps: float, down_bps: float, server_s: float, idle: float | None
    ) -> tuple[float, float, float]:
        """(latency, energy, money) of an offload on a steady link: this model, in closed form."""
        t_up = in_bytes * 8 / up_bps
        t_down = self.output_bytes * 8 / down_bps
        latency = self.promotion_s(idle) + t_up + self.rtt_s + server_s + t_down
        energy = transfer_energy_j(
            self.link,
            int(in_bytes),
            self.output_bytes,
            up_bps,
            down_bps,
            self.rtt_s + server_s,
            self.device,
            idle,
        )
        nbytes = in_bytes + self.output_bytes
        money = nbytes / 1e6 * self.link.cost_per_mb if self.link.metered else 0.0
        return latency, energy, money

    # -- cost ---------------------------------------------------------------------

    def cost(self, o: Outcome) -> float:
        w = self.weights
        latency = max(o.latency_s, o.deadline_s) if o.missed else o.latency_s
        if not math.isfinite(latency):
            latency = o.latency_s
        return (
            w.latency_s * latency
            + w.energy_j * o.energy_j
            + w.data_mb * (o.up_bytes + o.down_bytes) / 1e6
            + w.money * o.money
            + (self.miss_penalty if o.missed else 0.0)
        )


def no_answer(deadline_s: float, latency_s: float = 0.0) -> Outcome:
    """A request answered with an error (nothing could run it)."""
    return Outcome("none", latency_s, 0.0, 0, 0, 0.0, True, deadline_s)
