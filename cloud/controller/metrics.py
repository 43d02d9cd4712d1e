"""The controller's Prometheus families: placement as ModelMesh reports it.

Copies per model, memory used and capacity per node, nodes used against the
lower bound, moves, load latency (as the nodes measured it), cache misses
(requests for models no node hosted), and utilisation with the alerts in
force.  Read from the core at scrape time; written by :func:`render_metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cloud.controller.alerts import OVER, UNDER, UNPLACED
from cloud.metrics import render_metrics

if TYPE_CHECKING:
    from cloud.controller.core import ControllerCore


class _PlacementCollector:
    def __init__(self, core: ControllerCore) -> None:
        self.core = core

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        core = self.core
        placement = core.current
        copies = GaugeMetricFamily(
            "ferry_placement_copies", "Copies of the model in the placement", labels=["model"]
        )
        planned = GaugeMetricFamily(
            "ferry_placement_planned_rate",
            "Requests/s the copies are planned for",
            labels=["model"],
        )
        observed = GaugeMetricFamily(
            "ferry_model_request_rate", "Requests/s measured at the nodes", labels=["model"]
        )
        util = GaugeMetricFamily(
            "ferry_model_utilisation",
            "Measured / planned request rate over the alert window",
            labels=["model"],
        )
        alert = GaugeMetricFamily(
            "ferry_model_alert", "1 while the model has this alert", labels=["model", "kind"]
        )
        misses = CounterMetricFamily(
            "ferry_model_misses", "Requests for the model while no node hosted it", labels=["model"]
        )
        for name in sorted(core.catalogue):
            n = len(placement.copies_of(name)) if placement else 0
            copies.add_metric([name], n)
            planned.add_metric([name], core.planned_rates.get(name, 0.0))
            observed.add_metric([name], core.view.rate(name))
            ratio = core.tracker.utilisation(name)
            if ratio is not None:
                util.add_metric([name], ratio)
            misses.add_metric([name], core.view.misses(name))
        active = {(a.model, a.kind) for a in core.alerts()}
        for name in sorted(core.catalogue):
            for kind in (OVER, UNDER, UNPLACED):
                alert.add_metric([name, kind], 1.0 if (name, kind) in active else 0.0)
        yield from (copies, planned, observed, util, alert, misses)

        mem_used = GaugeMetricFamily(
            "ferry_node_memory_used_bytes",
            "Model memory the placement puts on the node",
            labels=["node"],
        )
        mem_total = GaugeMetricFamily(
            "ferry_node_memory_capacity_bytes", "Memory the node offers to models", labels=["node"]
        )
        occupancy = GaugeMetricFamily(
            "ferry_node_planned_occupancy",
            "Share of the node's time the placement plans",
            labels=["node"],
        )
        node_util = GaugeMetricFamily(
            "ferry_node_utilisation", "Busy share the node reports", labels=["node"]
        )
        load = GaugeMetricFamily(
            "ferry_model_load_seconds",
            "Last load-and-warm latency the node measured",
            labels=["node", "model"],
        )
        for state in core.view.online():
            if state.spec is not None:
                mem_total.add_metric([state.name], state.spec.memory_bytes)
            on_node = placement.on_node(state.name) if placement else []
            mem_used.add_metric([state.name], sum(c.memory_bytes for c in on_node))
            occupancy.add_metric([state.name], sum(c.occupancy for c in on_node))
            node_util.add_metric([state.name], state.utilisation)
            for model, seconds in sorted(state.load_seconds.items()):
                load.add_metric([state.name, model], seconds)
        yield from (mem_used, mem_total, occupancy, node_util, load)

        bounds = placement.bounds if placement else None
        summary = [
            (
                "ferry_placement_generation",
                "Generation of the placement in force",
                placement.generation if placement else 0,
            ),
            (
                "ferry_placement_nodes_used",
                "Nodes holding at least one copy",
                len(placement.nodes_used()) if placement else 0,
            ),
            ("ferry_placement_nodes_online", "Nodes reporting online", len(core.view.online())),
            (
                "ferry_placement_lower_bound_nodes",
                "Lower bound on the nodes any placement needs",
                bounds.nodes if bounds else 0,
            ),
            (
                "ferry_placement_unplaced_models",
                "Models the placement could not place",
                len(placement.unplaced) if placement else 0,
            ),
        ]
        for name, doc, value in summary:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        moves = CounterMetricFamily(
            "ferry_placement_moves", "Loads and unloads the controller ordered"
        )
        moves.add_metric([], core.moves_total)
        yield moves


def render_controller_metrics(core: ControllerCore) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PlacementCollector(core))
    return render_metrics(registry)
