"""What a node or the controller knows of the fleet, from retained broker messages.

Every node publishes its status retained on ``ferry/v1/nodes/{node}/status``
(and the broker publishes ``{"state": "offline"}`` there as the node's last
will when it dies); the controller publishes the placement retained on
``ferry/v1/placement``.  :class:`FleetView` folds those messages into one
picture: which nodes are up, what each hosts and can hold, how fast each
model's requests arrive.  It is sans-IO (messages and a clock in, answers
out), so the controller, the nodes and ``ferry-cloud fleet`` share it and
tests drive it without a broker.

Rates are computed from each node's cumulative request counters between two
of its reports, against the node's own uptime (its monotonic clock), so wall
clocks that disagree between machines do not matter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from cloud.placement.types import NodeSpec, Placement
from shared.mqtt.topics import DEFAULT_STATUS_INTERVAL_S, silence_limit_s, status_interval_s

#: smoothing of observed rates (per report): new = old + ALPHA * (sample - old)
RATE_ALPHA = 0.5

log = logging.getLogger(__name__)

#: Models whose measured memory is remembered after their hosts are gone.
REMEMBERED_MODELS = 10_000


@dataclass
class HostedModel:
    """One model on one node, as its last status reported it."""

    name: str
    requests: int = 0
    executions: int = 0
    compute_ns: int = 0
    queue_depth: int = 0
    memory_bytes: int = 0
    backend: str = ""
    rate: float = 0.0  # smoothed requests/s on this node
    rate_known: bool = False  # False until two reports gave a rate
    # Compute seconds per execution from the executions between reports (smoothed), and
    # how many executions that rests on: the ones before its first report, the first
    # after a load and the slowest, are left out.
    exec_s: float | None = None
    exec_count: int = 0


@dataclass
class NodeState:
    name: str
    online: bool = False
    spec: NodeSpec | None = None
    uptime_s: float = 0.0
    boot: str | None = None  # the node process's own id: a new one is a restart
    utilisation: float = 0.0
    queue_depth: int = 0
    following: int | None = None  # placement generation the node has converged to
    last_seen: float | None = None  # monotonic time of its last status (None: not timed)
    interval_s: float = DEFAULT_STATUS_INTERVAL_S  # how often it says it publishes one
    received: int | None = None  # the newest placement generation it has seen
    models: dict[str, HostedModel] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)  # requests for models not placed
    miss_rate: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # model -> V2 metadata
    configs: dict[str, Any] = field(default_factory=dict)  # model -> Triton config JSON
    http: str | None = None  # the node's HTTP address, for operators
    load_seconds: dict[str, float] = field(default_factory=dict)  # last load+warm latency
    load_failures: dict[str, str] = field(default_factory=dict)  # placed here, not loaded


# The shape of a node status: checked whole before any of it is folded in, so one
# malformed status (a bug, or a hand-made publish) changes nothing.  Folding it half
# had left a phantom node online for good, with copies placed on it.
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[float, msgspec.Meta(ge=0)]  # (NaN fails it too)
# a rate or a speed the packer divides by or multiplies with: finite (JSON's 1e999 is
# infinity) and, for a speed, above 0 (one node's status of speed 0 had crashed the
# controller, at every restart while it stayed retained)
_Rate = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
_Speed = Annotated[float, msgspec.Meta(gt=0, le=1e6)]


class _WireModel(msgspec.Struct):
    name: str = ""
    requests: _Count = 0
    executions: _Count = 0
    compute_ns: _Count = 0
    queue_depth: _Count = 0
    memory_bytes: _Count | None = None
    backend: str = ""
    rate: _Rate | None = None


class _WireCapacity(msgspec.Struct):
    memory_bytes: _Count = 0
    backends: list[str] = []
    speed: _Speed = 1.0
    cores: _Count = 0
    gpu: Any = None


class _WireStatus(msgspec.Struct):
    uptime_s: _Positive = 0.0
    boot: str | None = None
    interval_s: Any = None  # (a bad one falls back to the default)
    utilisation: _Positive = 0.0
    queue_depth: _Count = 0
    following: int | None = None
    received: Any = None
    http: str | None = None
    capacity: _WireCapacity | None = None
    models: list[_WireModel] = []
    misses: dict[str, _Count] = {}
    metadata: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    load_failures: Any = None
    load_seconds: dict[str, _Positive] = {}


def status_problem(status: dict[str, Any]) -> str | None:
    """Why ``status`` cannot be folded in (None: it can)."""
    try:
        msgspec.convert(status, _WireStatus, strict=False)
    except msgspec.ValidationError as exc:
        return str(exc)
    return None


class FleetView:
    """Nodes and their models, folded from status messages (no I/O)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.placement: Placement | None = None
        self.membership_changes = 0
        # A model's memory as last measured by any host: when its hosts die, re-placing it
        # must not fall back to its file's size (a node was filled to 2.2x its memory).
        self._measured: dict[str, int] = {}
        self._connected_at: float | None = None  # silence counts from here at the earliest
        # Every miss any node reported, summed from each report's increase: a counter that
        # keeps what nodes since gone counted (the online nodes' own sums went down when
        # one left, and Prometheus read the drop as a reset)
        self._missed: dict[str, int] = {}
        #: model -> when (the statuses' clock) a status last showed it asked for: its
        #: requests grew, or a miss; first seen hosted counts as now (a restarted
        #: controller cannot tell, and must not unload what may be in use)
        self._used: dict[str, float] = {}

    # ---- input -------------------------------------------------------------------
    def on_status(self, node: str, status: dict[str, Any] | None, now: float | None = None) -> bool:
        """Fold one status; True when the set of online nodes changed.  ``now``
        (monotonic) times it, for :meth:`expire`."""
        state = self.nodes.get(node)
        was_online = state is not None and state.online
        if not isinstance(status, dict) or status.get("state") in ("offline", "closing"):
            if state is not None:
                state.online = False
                state.models.clear()
            changed = was_online
        else:
            problem = status_problem(status)
            if problem is not None:
                log.warning("node %s: status ignored: %s", node, problem)
                return False
            first = state is None  # (its first status in this view: counters are a baseline)
            if state is None:
                state = self.nodes[node] = NodeState(node)
            self._fold(state, status, now, first)
            # Timed only when it says how often it reports (a node of an older version,
            # maybe on a 30 s interval, would flap on a guessed one).
            state.last_seen = now if "interval_s" in status else None
            changed = not was_online
        if changed:
            self.membership_changes += 1
        return changed

    def connected(self, now: float) -> None:
        """The watcher (re)connected to the broker: while it was away nothing could be
        heard, so nodes' silence counts from now (a broker outage longer than the bound
        took every healthy node offline at the first step after it)."""
        self._connected_at = now

    def expire(self, now: float) -> list[str]:
        """Take offline the nodes whose statuses stopped (timed ones only: those whose
        statuses say their interval); their names."""
        gone = []
        for state in self.nodes.values():
            if not state.online or state.last_seen is None:
                continue
            since = state.last_seen
            if self._connected_at is not None and self._connected_at > since:
                since = self._connected_at
            silent = now - since
            if silent > silence_limit_s(state.interval_s):
                state.online = False
                state.models.clear()
                gone.append(state.name)
                log.warning("no status from node %s for %.0f s: offline", state.name, silent)
        if gone:
            self.membership_changes += 1
        return gone

    def on_placement(self, document: dict[str, Any] | None) -> Placement | None:
        """The placement in force, or None when ``document`` is older than it: generations
        only grow (a controller that lost the broker's store continues from the ones
        the nodes follow), so an older one is a stale retained copy or a controller
        that lost its standing, never news."""
        placement = Placement.from_dict(document) if isinstance(document, dict) else None
        current = self.placement
        if placement is not None and current is not None:
            if placement.generation < current.generation:
                log.warning(
                    "ignoring placement %d: placement %d is in force",
                    placement.generation,
                    current.generation,
                )
                return None
        self.placement = placement
        return placement

    def _fold(
        self,
        state: NodeState,
        status: dict[str, Any],
        now: float | None = None,
        first: bool = False,
    ) -> None:
        uptime = float(status.get("uptime_s", 0.0))
        boot = status.get("boot")
        boot = str(boot) if boot is not None else None
        # A restart: a new process (its boot id), or, from a node that sends none, an
        # uptime that went back (which misses a node up longer than it had been before
        # the view heard it again: its counters had been read against the old ones).
        restarted = uptime < state.uptime_s or (
            boot is not None and state.boot is not None and boot != state.boot
        )
        elapsed = uptime - state.uptime_s if state.online and not restarted else 0.0
        state.online = True
        state.uptime_s = uptime
        if boot is not None:  # (a status without one says nothing of the process)
            state.boot = boot
        state.interval_s = status_interval_s(status.get("interval_s"))
        state.utilisation = float(status.get("utilisation", 0.0))
        state.queue_depth = int(status.get("queue_depth", 0))
        following = status.get("following")
        state.following = int(following) if following is not None else None
        received = status.get("received")
        state.received = int(received) if isinstance(received, int) else None
        state.http = status.get("http")
        capacity = status.get("capacity")
        if isinstance(capacity, dict):
            state.spec = NodeSpec(
                name=state.name,
                memory_bytes=int(capacity.get("memory_bytes", 0)),
                backends=frozenset(capacity.get("backends", ())),
                speed=float(capacity.get("speed", 1.0)),
                cores=int(capacity.get("cores", 0)),
                gpu=capacity.get("gpu"),
            )
        models: dict[str, HostedModel] = {}
        for entry in status.get("models", ()):
            name = str(entry.get("name", ""))
            if not name:
                continue
            old = state.models.get(name)
            hosted = HostedModel(
                name=name,
                requests=int(entry.get("requests", 0)),
                executions=int(entry.get("executions", 0)),
                compute_ns=int(entry.get("compute_ns", 0)),
                queue_depth=int(entry.get("queue_depth", 0)),
                memory_bytes=int(entry.get("memory_bytes") or 0),
                backend=str(entry.get("backend", "")),
            )
            reported = entry.get("rate")  # the node's own figure, until two reports give one
            hosted.rate = float(reported) if isinstance(reported, int | float) else 0.0
            if name in models:  # several versions: one model, summed
                first = models[name]
                if old is None:
                    first.rate += hosted.rate
                first.requests += hosted.requests
                first.executions += hosted.executions
                first.compute_ns += hosted.compute_ns
                first.queue_depth += hosted.queue_depth
                first.memory_bytes += hosted.memory_bytes
                continue
            if old is not None:
                hosted.rate, hosted.rate_known = old.rate, old.rate_known
            models[name] = hosted
        for name, hosted in models.items():
            old = state.models.get(name)
            if old is not None and not restarted:
                runs = hosted.executions - old.executions
                spent = hosted.compute_ns - old.compute_ns
                hosted.exec_s, hosted.exec_count = old.exec_s, old.exec_count
                if runs > 0 and spent >= 0:
                    sample = spent / runs / 1e9
                    hosted.exec_s = (
                        sample
                        if old.exec_s is None
                        else old.exec_s + RATE_ALPHA * (sample - old.exec_s)
                    )
                    hosted.exec_count = old.exec_count + runs
            if now is not None and (old is None or hosted.requests > old.requests or restarted):
                self._used_at(name, now)
            if old is not None and elapsed > 0 and not restarted:
                sample = max(0, hosted.requests - old.requests) / elapsed
                if old.rate_known:
                    hosted.rate = old.rate + RATE_ALPHA * (sample - old.rate)
                else:
                    hosted.rate = sample
                hosted.rate_known = True
        state.models = models
        for name, hosted in models.items():
            if hosted.memory_bytes > 0:
                self._measured.pop(name, None)  # (re-inserted last: the oldest go first)
                self._measured[name] = hosted.memory_bytes
        while len(self._measured) > REMEMBERED_MODELS:
            del self._measured[next(iter(self._measured))]
        misses = {str(k): int(v) for k, v in dict(status.get("misses", {})).items()}
        for name, count in misses.items():
            before = state.misses.get(name)
            counted = before if before is not None and not restarted else 0
            if count > counted:
                self._missed[name] = self._missed.pop(name, 0) + count - counted
                # (a node's first status in this view is its baseline: the misses it counted
                # before a controller restart are not news, and had reloaded every idle
                # min_copies = 0 model it ever missed)
                if now is not None and (not first or restarted):
                    self._used_at(name, now)
            if before is not None and elapsed > 0 and not restarted:
                sample = max(0, count - before) / elapsed
                old_rate = state.miss_rate.get(name)
                state.miss_rate[name] = (
                    sample if old_rate is None else old_rate + RATE_ALPHA * (sample - old_rate)
                )
        state.misses = misses
        while len(self._missed) > REMEMBERED_MODELS:
            del self._missed[next(iter(self._missed))]
        # (a status too big for the broker leaves them out: the last ones stand)
        if "metadata" in status:
            state.metadata = dict(status["metadata"])
        if "configs" in status:
            state.configs = dict(status["configs"])
        failures = status.get("load_failures")
        state.load_failures = (
            {str(k): str(v)[:500] for k, v in failures.items()}
            if isinstance(failures, dict)
            else {}
        )
        state.load_seconds = {
            str(k): float(v) for k, v in dict(status.get("load_seconds", {})).items()
        }

    # ---- answers ------------------------------------------------------------------
    def online(self) -> list[NodeState]:
        return [s for _, s in sorted(self.nodes.items()) if s.online]

    def specs(self) -> list[NodeSpec]:
        return [s.spec for s in self.online() if s.spec is not None]

    def hosts(self, model: str, exclude: str | None = None) -> list[str]:
        """Online nodes that report ``model`` loaded (its copies serving now)."""
        return [s.name for s in self.online() if model in s.models and s.name != exclude]

    def rate(self, model: str) -> float:
        """Requests/s for ``model`` across the fleet, misses (unplaced) included."""
        served = sum(s.models[model].rate for s in self.online() if model in s.models)
        missed = sum(s.miss_rate.get(model, 0.0) for s in self.online())
        return served + missed

    def rate_known(self, model: str) -> bool:
        """True once every online node hosting ``model`` has reported a rate for it."""
        hosting = [s.models[model] for s in self.online() if model in s.models]
        return bool(hosting) and all(h.rate_known for h in hosting)

    def _used_at(self, model: str, now: float) -> None:
        self._used.pop(model, None)  # (re-inserted last: the oldest go first)
        self._used[model] = now
        while len(self._used) > REMEMBERED_MODELS:
            del self._used[next(iter(self._used))]

    def last_used(self, model: str) -> float | None:
        """When a status last showed ``model`` asked for (its requests grew, or a miss)."""
        return self._used.get(model)

    def misses(self, model: str) -> int:
        """Requests for ``model`` any node got while no node hosted it, since this view
        began (a counter: it never goes down)."""
        return self._missed.get(model, 0)

    def observed_profile(self, model: str) -> tuple[float, int] | None:
        """(mean compute seconds per execution, executions it rests on) over the fleet,
        from the executions between reports (see HostedModel.exec_s), or None."""
        hosts = [
            s.models[model]
            for s in self.online()
            if model in s.models and s.models[model].exec_s is not None
        ]
        count = sum(h.exec_count for h in hosts)
        if count == 0:
            return None
        return sum(h.exec_s * h.exec_count for h in hosts if h.exec_s) / count, count

    def memory_of(self, model: str) -> int:
        """The model's measured memory: its hosts' now, else as last measured anywhere."""
        values = [s.models[model].memory_bytes for s in self.online() if model in s.models]
        values = [v for v in values if v > 0]
        return max(values) if values else self._measured.get(model, 0)

    def metadata(self, model: str) -> dict[str, Any] | None:
        for state in self.online():
            if model in state.metadata:
                return state.metadata[model]
        return None

    def config(self, model: str) -> dict[str, Any] | None:
        for state in self.online():
            if model in state.configs:
                return state.configs[model]
        return None
