"""The controller's decisions, sans-IO: statuses and a clock in, placements out.

When to re-place:
- at once when nodes join or leave (a dead node's models need a new home,
  a new node should take load);
- every ``interval_s`` when some model's rate moved by more than
  ``rate_tolerance`` (relative) since the placement in force was computed;
- never before ``settle_s`` after start, so a restarted controller first reads
  the retained placement and the nodes' retained statuses and then, with the
  same input, computes the same placement (incremental packing keeps every
  copy still feasible): a restart moves nothing;
- nor before the nodes had time to reconnect after the controller's own
  reconnection (:meth:`ControllerCore.reconnected`): a broker that stops
  publishes every client's last will, so for a moment the whole fleet reads
  offline, and a step then moved models off nodes that were back half a
  second later.

What it places: every model of the repository, at ``max(declared rate,
measured rate)``, with the latency profile ``ferry-cloud tune`` measured
(or, lacking one, a rough one from the compute time nodes report).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from cloud.controller.alerts import Alert, AlertSettings, UtilisationTracker
from cloud.controller.catalogue import ModelEntry
from cloud.fleet.view import FleetView
from cloud.placement.packing import Headroom, Move, moves, place
from cloud.placement.types import LatencyProfile, ModelDemand, Placement

log = logging.getLogger(__name__)

#: a model that failed to load on a node is not placed there again for this long
FAILED_LOAD_HOLD_S = 300.0

#: a model with no profile and no measurement is planned as this (seconds)
FALLBACK_A_S = 0.005
FALLBACK_BETA_S = 0.002
#: what a min_copies = 0 model in use is planned at, at least: its one copy, however
#: rare its requests (below alerts.MIN_PLANNED_RATE: no "over-provisioned" for it)
IN_USE_FLOOR = 0.005

#: executions (over the fleet, after each host's first report) before their mean compute
#: time stands for the model: the first runs after a load are the slow ones (8 cold runs
#: of a 21 ms model read as one too slow for its objective, and its serving copy was
#: unplaced for "no room"); the view leaves those out (FleetView.observed_profile)
OBSERVED_MIN_EXECUTIONS = 20


@dataclass(frozen=True)
class ControllerSettings:
    interval_s: float = 10.0
    settle_s: float = 2.0
    rate_tolerance: float = 0.25
    min_rate_change: float = 0.5  # req/s: smaller moves never trigger a re-placement
    #: a min_copies = 0 model asked for by no request for this long is unloaded (its
    #: measured rate had decayed to ~0 without ever being a change worth a step)
    idle_unload_s: float = 300.0
    headroom: Headroom | None = None
    alerts: AlertSettings = field(default_factory=AlertSettings)


@dataclass
class Step:
    """One published change."""

    placement: Placement
    moves: list[Move]
    reason: str


class ControllerCore:
    def __init__(
        self,
        catalogue: dict[str, ModelEntry],
        profiles: dict[str, list[LatencyProfile]] | None = None,
        settings: ControllerSettings | None = None,
        *,
        started: float = 0.0,
    ) -> None:
        self.catalogue = catalogue
        self.profiles = profiles or {}
        self.settings = settings or ControllerSettings()
        self.view = FleetView()
        self.tracker = UtilisationTracker(self.settings.alerts)
        self.current: Placement | None = None
        self.planned_rates: dict[str, float] = {}
        self.started = started
        self.settle_until = -math.inf  # (see reconnected)
        self.last_step = -math.inf
        self.now = -math.inf  # the clock of the last step
        self.moves_total = 0
        self.steps = 0
        self._membership_dirty = True
        # (model, node) -> (why, when last reported): where a placed model failed to load
        self.load_failed: dict[tuple[str, str], tuple[str, float]] = {}

    # ---- input -------------------------------------------------------------------
    def reconnected(self, now: float, nodes_back_within_s: float) -> None:
        """Back on the broker: nothing was heard while away, and the nodes, reconnecting
        on their own backoff, come back within ``nodes_back_within_s``; until then
        membership is not news (their retained wills say offline)."""
        self.view.connected(now)
        self.settle_until = now + max(self.settings.settle_s, nodes_back_within_s)

    def on_status(self, node: str, document: Any, now: float | None = None) -> None:
        if self.view.on_status(node, document, now):
            self._membership_dirty = True

    def on_retained_placement(self, document: Any) -> None:
        """The placement last published (by us before a restart): the starting point."""
        placement = self.view.on_placement(document)
        if placement is not None and (
            self.current is None or placement.generation > self.current.generation
        ):  # (a controller standing by follows the active one's)
            self.current = placement
            self.planned_rates = {}
            for copy in placement.copies:
                self.planned_rates[copy.model] = self.planned_rates.get(copy.model, 0) + copy.rate

    def on_catalogue(self, catalogue: dict[str, ModelEntry]) -> tuple[list[str], list[str]]:
        """The repository read again: (models added, models gone).  Any change places
        again at the next step (a new model needs a home, a gone one frees its copies)."""
        added = sorted(set(catalogue) - set(self.catalogue))
        removed = sorted(set(self.catalogue) - set(catalogue))
        if catalogue != self.catalogue:
            self.catalogue = catalogue
            self._membership_dirty = True
        return added, removed

    # ---- decisions ---------------------------------------------------------------
    def demand_rate(self, entry: ModelEntry, rates_in_force: bool = False) -> float:
        """The rate to plan for: the declared one, or more when more is measured.  Until
        the hosting nodes have reported twice, the rate in force stands (a restarted
        controller must not shrink a model it cannot measure yet)."""
        name = entry.name
        if rates_in_force and name in self.planned_rates:
            measured = self.planned_rates[name]
        elif self.view.rate_known(name) or not self.view.hosts(name):
            measured = self.view.rate(name)
        else:
            measured = self.planned_rates.get(name, 0.0)
        rate = max(entry.policy.rate, measured)
        if entry.policy.min_copies == 0 and entry.policy.rate <= 0:
            # Loaded while asked for (a miss loads it: ModelMesh's cache), unloaded once
            # idle: a few requests a minute are no rate change worth a step, so by rate
            # alone such a model was never loaded, and once loaded never left.
            if not self.in_use(name):
                return 0.0
            rate = max(rate, IN_USE_FLOOR)
        return rate

    def in_use(self, name: str) -> bool:
        """Whether ``name`` was asked for within ``idle_unload_s``."""
        used = self.view.last_used(name)
        return used is not None and self.now - used <= self.settings.idle_unload_s

    def profiles_for(self, entry: ModelEntry) -> tuple[LatencyProfile, ...]:
        measured = self.view.memory_of(entry.name)
        tuned = [p for p in self.profiles.get(entry.name, ()) if p.backend in entry.backends]
        if tuned:
            return tuple(tuned)
        observed = self.view.observed_profile(entry.name)
        if observed is not None and observed[1] < OBSERVED_MIN_EXECUTIONS:
            observed = None
        per_exec = observed[0] if observed else FALLBACK_A_S + FALLBACK_BETA_S
        a = per_exec * 0.5 if observed else FALLBACK_A_S
        beta = max(per_exec * 0.5, 1e-5) if observed else FALLBACK_BETA_S
        if not self.view.hosts(entry.name):
            # As last measured, or as the repository now says if that is more (a new,
            # bigger version placed while no copy runs)
            measured = max(measured, entry.memory_bytes)
        memory = measured or entry.memory_bytes
        return tuple(
            LatencyProfile(backend, a, beta, entry.max_batch, memory) for backend in entry.backends
        )

    def demands(self, rates_in_force: bool = False) -> list[ModelDemand]:
        """What to place; ``rates_in_force`` keeps the rates the placement in force was
        computed for (steps caused by nodes coming and going re-home copies, they do
        not re-size them: that waits for a rate step)."""
        out = []
        for name, entry in sorted(self.catalogue.items()):
            policy = entry.policy
            out.append(
                ModelDemand(
                    name=name,
                    rate=self.demand_rate(entry, rates_in_force),
                    slo_s=policy.latency_objective_ms / 1000.0,
                    profiles=self.profiles_for(entry),
                    min_copies=policy.min_copies,
                    max_copies=policy.max_copies,
                    avoid=frozenset(n for m, n in self.load_failed if m == name),
                )
            )
        return out

    def _woken(self) -> str | None:
        """A model placed nowhere that is asked for now (a miss): placed at once."""
        for name, entry in sorted(self.catalogue.items()):
            if entry.policy.min_copies > 0:
                continue  # (placed anyway: its rate waits for the interval)
            if self.planned_rates.get(name, 0.0) <= 0 and self.demand_rate(entry) > 0:
                return f"{name} asked for (a miss)"
        return None

    def _rates_moved(self) -> str | None:
        s = self.settings
        for name, entry in sorted(self.catalogue.items()):
            now = self.demand_rate(entry)
            before = self.planned_rates.get(name, 0.0)
            if (now > 0) != (before > 0) and entry.policy.min_copies == 0:
                if now > 0:
                    return f"{name} asked for"
                return f"{name} idle for {self.settings.idle_unload_s:g} s: unloaded"
            change = abs(now - before)
            if change >= s.min_rate_change and change > s.rate_tolerance * max(before, 1e-9):
                return f"rate of {name} {before:.1f} -> {now:.1f} req/s"
        return None

    def step(self, now: float) -> Step | None:
        """Recompute when due; a :class:`Step` when the placement changed."""
        self.now = now
        self._observe(now)
        if now - self.started < self.settings.settle_s or now < self.settle_until:
            return None
        nodes = self.view.specs()
        if not nodes:
            return None  # an empty fleet keeps the last placement (static stability)
        reason = None
        rate_step = False
        if self._membership_dirty:
            reason = "nodes " + ",".join(sorted(n.name for n in nodes))
        elif self.current is None:
            reason = "first placement"
        elif (reason := self._woken()) is not None:
            rate_step = True
        elif now - self.last_step >= self.settings.interval_s:
            reason = self._rates_moved()
            rate_step = reason is not None
        if reason is None:
            return None
        demands = self.demands(rates_in_force=not rate_step and self.current is not None)
        new = place(demands, nodes, self.current, headroom=self.settings.headroom)
        # (only now: a placement that raised leaves its reason to the next try, which had
        # found none, the nodes gone still planned)
        self._membership_dirty = False
        self.last_step = now
        old = self.current
        if old is not None and _same(old, new):
            self.planned_rates = {d.name: d.rate for d in demands}
            return None
        if (
            old is not None
            and not rate_step
            and not moves(old, new)
            and old.unplaced == new.unplaced
        ):
            # nodes came or went (or a restarted controller met the fleet) and nothing
            # has to move: the placement in force stands; rates wait for their interval
            return None
        self.planned_rates = {d.name: d.rate for d in demands}
        if old is not None and new.generation <= old.generation:
            new = _with_generation(new, old.generation + 1)
        elif old is None:
            # No placement retained (a broker that lost its store): the generations
            # the nodes still follow say where the count was, and it only grows.
            followed = max(
                (max(s.following or 0, s.received or 0) for s in self.view.online()), default=0
            )
            if new.generation <= followed:
                new = _with_generation(new, followed + 1)
        changes = moves(old or Placement(), new)
        self.current = new
        self.moves_total += len(changes)
        self.steps += 1
        log.info(
            "placement %d (%s): %d copies on %d nodes, %d moves, %d unplaced",
            new.generation,
            reason,
            len(new.copies),
            len(new.nodes_used()),
            len(changes),
            len(new.unplaced),
        )
        return Step(new, changes, reason)

    def _observe(self, now: float) -> None:
        if self.view.expire(now):  # silent nodes are gone: their copies go elsewhere
            self._membership_dirty = True
        # A copy that fails to load goes elsewhere (at once: the node stays unready
        # while it holds a failed load), and is tried there again after a hold.
        for state in self.view.online():
            for model, why in state.load_failures.items():
                if (model, state.name) not in self.load_failed:
                    log.warning("model %s failed to load on %s: %s", model, state.name, why)
                    self._membership_dirty = True
                self.load_failed[(model, state.name)] = (why, now)
        for key, (_, seen) in list(self.load_failed.items()):
            if now - seen > FAILED_LOAD_HOLD_S or key[0] not in self.catalogue:
                del self.load_failed[key]
                self._membership_dirty = True
        planned: dict[str, float] = {}
        if self.current is not None:
            for copy in self.current.copies:
                planned[copy.model] = planned.get(copy.model, 0.0) + copy.rate
        for name in self.catalogue:
            self.tracker.observe(now, name, self.view.rate(name), planned.get(name, 0.0))
        self.tracker.forget(set(self.catalogue))

    def alerts(self) -> list[Alert]:
        return self.tracker.alerts(self.current)


def _same(a: Placement, b: Placement) -> bool:
    return a.copies == b.copies and a.unplaced == b.unplaced


def _with_generation(p: Placement, generation: int) -> Placement:
    return Placement(copies=p.copies, unplaced=p.unplaced, generation=generation, bounds=p.bounds)
