"""Lower bounds on the nodes any placement needs: the yardstick for the packer.

What is bounded: any way at all of serving each model's requests on nodes -
any batching, any order, any sharing of a node's time, even a scheduler that
knows every arrival in advance - that answers all but a share ``eps`` of each
model's requests within its objective ``L``, in the long run.  Ferry's
nodes are one such way, so no placement the packer makes can beat it; it
does not assume the packer's model of a node (:mod:`cloud.placement.sizing`).

Compute.  A node gives one second of its time per second (``s``: its speed;
the fastest node's is used, which only lowers the bound).  A batch of ``b``
requests of a model on profile ``p`` takes ``(a_p + beta_p*b)/s``; below,
``a``, ``beta`` are the least over the model's usable profiles (a model's
copies may mix profiles), so each batch costs at least ``a + beta*b``.  Over a
long time ``H`` with ``n = r*H`` requests in ``K`` batches the model takes at
least ``a*K + beta*n`` of node time.  Two counts bound ``K``:

* a batch holds at most ``B = max_p min(max_batch_p, (s*L - a_p)/beta_p)``
  requests (more would not finish within ``L`` even alone), so ``K >= n/B``;
* the requests of one batch that are in time all arrived within a window of
  ``w = L - min_p l_p(1)/s`` (the batch starts after its last member arrives
  and its first must be answered ``L`` after arriving).  So the batches that
  hold in-time requests are at least the fewest windows of length ``w`` that
  cover those requests' arrival times, and that is at least the fewest that
  cover all arrivals less the late requests (dropping one point lowers the
  fewest covering windows by at most one).  The greedy cover (a window from
  each first uncovered arrival) is the fewest, and on a renewal process it
  is a renewal: each window starts at an arrival and the next one at the
  first arrival after ``w``, ``w + R_w`` later, with ``E[R_w] = 1/r`` for
  Poisson arrivals (no memory) and ``E[R_w] <= (1 + cv^2)/r`` for any renewal
  process of CV ``cv`` (Lorden's inequality).  So
  ``K/H >= r/(r*w + c) - eps*r`` with ``c = 1`` (Poisson) or ``1 + cv^2``.

Hence ``nodes >= sum_i (beta*r + a*max(r/B, r/(r*w + c) - eps*r)) / s``: the
overhead of batching, at the most any scheduler can batch.  Each term is a
concave function of the rate that is 0 at 0, so splitting a model's traffic
over copies (each a renewal process, as the broker's shared subscription
and the benchmark give them) only adds to it.  DESIGN.md's
``r*beta*L/(L - a)`` is the first count (``B <= (L - a)/beta``) for a single
profile; the larger of the two is kept (DESIGN's, taken as the least over the
profiles, holds for mixed profiles too: it is linear in the rate).

Memory: a model keeps at least ``k`` copies on distinct nodes: ``min_copies``,
one if it has traffic, and as many as its compute bound in whole nodes (one
copy gets at most one node's time); each holds its smallest profile's memory,
and no node holds more than the largest node's memory.

Models no placement can hold (no node runs a backend of theirs, too big, an
objective below ``l(1)``: one request alone on the fastest node) add nothing;
a model held to fewer copies than its rate needs (``max_copies``, few nodes
that run it) counts the rate those copies can serve: at most ``s*B/(a + beta*B)``
each, batches of ``B`` back to back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cloud.placement.sizing import EPS, Headroom
from cloud.placement.types import Bounds, LatencyProfile, ModelDemand, NodeSpec


def batch_cap(p: LatencyProfile, slo_s: float, speed: float) -> float:
    """The largest batch of ``p`` that finishes within ``slo_s`` alone (0: none)."""
    room = (speed * slo_s - p.a_s) / p.beta_s
    return max(0.0, min(float(p.max_batch), math.floor(room + 1e-9)))


def model_time(
    usable: Sequence[LatencyProfile], rate: float, slo_s: float, speed: float, headroom: Headroom
) -> float:
    """The least node time per second any schedule gives ``rate`` requests/s of a model
    with those profiles (module docstring), in nodes of ``speed``."""
    if rate <= 0 or not usable:
        return 0.0
    a = min(p.a_s for p in usable) / speed
    beta = min(p.beta_s for p in usable) / speed
    top = max(batch_cap(p, slo_s, speed) for p in usable)
    window = slo_s - min(p.latency(1, speed) for p in usable)
    tail = 1.0 if headroom.cv == 1.0 else 1.0 + headroom.cv * headroom.cv
    batches = max(rate / top, rate / (rate * window + tail) - headroom.late * rate)
    design = min(p.beta_s * rate * slo_s / (slo_s - p.a_s / speed) / speed for p in usable)
    return max(beta * rate + a * batches, design)


def copy_rate(usable: Sequence[LatencyProfile], slo_s: float, speed: float) -> float:
    """The most requests/s one copy can serve: a node running its largest batches back
    to back."""
    return max(
        (speed * batch_cap(p, slo_s, speed) / p.latency(batch_cap(p, slo_s, speed))) for p in usable
    )


def lower_bounds(
    models: Sequence[ModelDemand], nodes: Sequence[NodeSpec], headroom: Headroom | None = None
) -> Bounds:
    """Compute and memory bounds, in nodes, for the models that can be placed at all,
    for schedules that keep ``headroom.quantile`` of each model's requests in time
    under arrivals of CV ``headroom.cv`` (default: :class:`Headroom`'s).

    Valid for every placement that serves each model's rate (see the module
    docstring for the proof); a packer is graded by how close it comes."""
    compute, memory = bound_sums(models, nodes, headroom)
    return Bounds(math.ceil(compute - 1e-6), math.ceil(memory - 1e-9))


def bound_sums(
    models: Sequence[ModelDemand], nodes: Sequence[NodeSpec], headroom: Headroom | None = None
) -> tuple[float, float]:
    """The two bounds before rounding up: nodes of compute, nodes of memory."""
    headroom = headroom if headroom is not None else Headroom()
    if not nodes:
        return 0.0, 0.0
    speed = max(n.speed for n in nodes)
    largest = max(n.memory_bytes for n in nodes)
    alike: dict[tuple[int, frozenset[str]], int] = {}
    for n in nodes:
        alike[(n.memory_bytes, n.backends)] = alike.get((n.memory_bytes, n.backends), 0) + 1
    compute, memory = 0.0, 0
    for demand in models:
        usable = [
            p
            for p in demand.profiles
            if any(p.backend in b and p.memory_bytes <= m for m, b in alike)
            and p.latency(1, speed) <= demand.slo_s
        ]
        if not usable or (demand.rate <= 0 and demand.min_copies <= 0):
            continue
        runnable = sum(
            count
            for (m, b), count in alike.items()
            if any(p.backend in b and p.memory_bytes <= m for p in usable)
        )
        cap = min(runnable, demand.max_copies or runnable)
        rate = min(max(demand.rate, 0.0), cap * copy_rate(usable, demand.slo_s, speed))
        time = model_time(usable, rate, demand.slo_s, speed, headroom)
        least = max(demand.min_copies, 1 if rate > 0 else 0, math.ceil(time - EPS))
        compute += time
        memory += min(least, cap) * min(p.memory_bytes for p in usable)
    return compute, memory / largest if largest > 0 else 0.0  # (every node 0 bytes)
