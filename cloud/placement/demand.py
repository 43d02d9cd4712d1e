"""From a model's demand to the copies the packer places, or why there are none.

A model whose rate exceeds what one node serves (a copy alone on a node, its
batches at the node's full speed) gets whole-node copies and one residual
copy; ``min_copies`` spreads the rate evenly over more copies; one copy per node and
``max_copies`` cap the count.  Whatever cannot be honoured is said in words:
the controller publishes those words and raises them as alerts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cloud.placement.sizing import Headroom, Slot, full_rate, size
from cloud.placement.types import LatencyProfile, ModelDemand, NodeSpec

IDLE = "idle"


@dataclass(eq=False)
class Item:
    """A copy waiting for a node: ``rate`` is its share of the model's traffic."""

    demand: ModelDemand
    rate: float
    index: int
    headroom: Headroom
    alone: float = 0.0  # its need on the best runnable node: the share it asks (sort key)
    memory: int = 0  # its smallest profile's memory
    floor: float = 0.0  # a share of a node it keeps busy at least, wherever it goes
    _slots: dict[tuple[int, float], Slot] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.demand.name

    @property
    def key(self) -> tuple[str, int]:
        return (self.demand.name, self.index)

    def slot(self, profile_index: int, speed: float) -> Slot:
        """The copy sized with one of its profiles on a node of ``speed`` (cached)."""
        found = self._slots.get((profile_index, speed))
        if found is None:
            profile = self.demand.profiles[profile_index]
            found = size(profile, self.rate, self.demand.slo_s, speed, self.headroom)
            self._slots[(profile_index, speed)] = found
        return found

    def options(self, node: NodeSpec) -> list[tuple[int, LatencyProfile]]:
        """Its profiles that ``node`` runs, by index (stable order)."""
        if node.name in self.demand.avoid:
            return []  # it failed to load there
        return [
            (i, p)
            for i, p in enumerate(self.demand.profiles)
            if p.backend in node.backends and p.memory_bytes <= node.memory_bytes
        ]


def size_text(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / (1 << 30):.1f} GiB"
    return f"{count / (1 << 20):.0f} MiB"


def fits_alone(p: LatencyProfile, demand: ModelDemand, node: NodeSpec, headroom: Headroom) -> bool:
    """A trickle of the model's requests meets its objective on ``node`` alone: one
    request at a time, at the node's full speed, ``l(1) <= L``."""
    return (
        p.backend in node.backends
        and p.memory_bytes <= node.memory_bytes
        and p.latency(1, node.speed) <= demand.slo_s
    )


def kinds(nodes: Sequence[NodeSpec]) -> list[tuple[NodeSpec, int]]:
    """Nodes that look alike to a copy (speed, memory, backends): one of each, and how
    many; fleets are mostly identical nodes, so this keeps sizing cheap."""
    seen: dict[tuple, list] = {}
    for n in sorted(nodes, key=lambda n: n.name):
        key = (n.speed, n.memory_bytes, tuple(sorted(n.backends)))
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [n, 1]
    return [(n, count) for n, count in seen.values()]


def runnable(
    demand: ModelDemand, fleet: Sequence[tuple[NodeSpec, int]], headroom: Headroom
) -> list[tuple[NodeSpec, int]]:
    """The kinds of node (from :func:`kinds`) one copy of the model could use by
    itself (backend, memory, latency), with how many of each."""
    return [
        (n, count)
        for n, count in fleet
        if any(fits_alone(p, demand, n, headroom) for p in demand.profiles)
    ]


def why_nowhere(demand: ModelDemand, nodes: Sequence[NodeSpec]) -> str:
    """The first of backend, memory, latency that rules out every node."""
    if not demand.profiles:
        return "no latency profile (run ferry-cloud tune)"
    if not nodes:
        return "no nodes"
    pairs = [(p, n) for p in demand.profiles for n in nodes if p.backend in n.backends]
    if not pairs:
        wanted = " or ".join(sorted({p.backend for p in demand.profiles}))
        return f"no node runs backend {wanted}"
    fitting = [(p, n) for p, n in pairs if p.memory_bytes <= n.memory_bytes]
    if not fitting:
        need = min(p.memory_bytes for p, _ in pairs)
        have = max(n.memory_bytes for _, n in pairs)
        return f"needs {size_text(need)}, the largest node that runs it offers {size_text(have)}"
    p, n = min(fitting, key=lambda pn: (pn[0].a_s + pn[0].beta_s) / pn[1].speed)
    batch1 = p.latency(1, n.speed)
    return (
        f"SLO {demand.slo_s * 1000:.1f} ms below {batch1 * 1000:.1f} ms: one request "
        f"alone on the fastest node that runs it takes that long"
    )


def split(
    demand: ModelDemand, fleet: Sequence[tuple[NodeSpec, int]], headroom: Headroom
) -> tuple[list[Item], str | None]:
    """The copies of one model and, when not all it asks for can be met, why;
    ``fleet`` is the nodes as :func:`kinds` groups them."""
    if demand.rate <= 0 and demand.min_copies <= 0:
        return [], IDLE
    usable = runnable(demand, fleet, headroom)
    hosts = [n for n, _ in usable]
    if not hosts:
        return [], why_nowhere(demand, [n for n, _ in fleet])
    reach = sum(count for _, count in usable)
    slowest = min(hosts, key=lambda n: (n.speed, n.name))
    rate = max(demand.rate, 0.0)
    cap = min(reach, demand.max_copies or reach)
    alone = [p for p in demand.profiles if fits_alone(p, demand, slowest, headroom)]
    if any(size(p, rate, demand.slo_s, slowest.speed, headroom).theta <= 1 for p in alone):
        top, full, rest = rate, 0, rate  # one copy serves it all (a search would say more)
    else:
        top = max(full_rate(p, demand.slo_s, slowest.speed, headroom) for p in alone)
        full = int(rate // top) if top > 0 else 0
        if full > cap:  # more than the nodes can hold: capped below (no list of 1e300)
            full, rest = cap + 1, 0.0
        else:
            rest = rate - full * top
    rates = [top] * full + ([rest] if rest > 1e-9 * max(rate, 1.0) or full == 0 else [])
    # (min_copies past the nodes: as many as they hold, and a note)
    want = max(min(demand.min_copies, cap + 1), len(rates))
    if want > len(rates):  # min_copies: spread the traffic evenly
        rates = [rate / want] * want
    note = None
    if len(rates) > cap:
        served = min(rate, cap * top)
        rates = [served / cap] * cap
        if served < rate * (1 - 1e-9):
            limit = (
                f"capped at max_copies {demand.max_copies}"
                if demand.max_copies and demand.max_copies < reach
                else f"only {reach} nodes can run it"
            )
            note = f"{limit}: plans {served:.1f} of {rate:.1f} req/s"
        elif demand.min_copies > cap and cap == reach:
            note = f"{cap} of min_copies {demand.min_copies}: only {cap} nodes can run it"
        elif demand.min_copies > cap:  # (config.toml refuses it; a caller of place() may not)
            note = f"{cap} of min_copies {demand.min_copies}: capped at max_copies {cap}"
    items = [Item(demand, r, i, headroom) for i, r in enumerate(rates)]
    for item in items:
        slots = [item.slot(i, n.speed) for n in hosts for i, _ in item.options(n)]
        item.alone = min(s.theta for s in slots)
        item.memory = min(p.memory_bytes for n in hosts for _, p in item.options(n))
        item.floor = min(s.floor for s in slots)
    return items, note
