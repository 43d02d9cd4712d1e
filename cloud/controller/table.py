"""The fleet as a document and as tables (``ferry-cloud fleet``, the controller's
``/fleet``): nodes, models, copies, rates, utilisation, alerts.  Pure."""

from __future__ import annotations

from typing import Any

from cloud.fleet.view import FleetView


def fleet_document(view: FleetView, alerts: list[Any]) -> dict[str, Any]:
    placement = view.placement
    nodes = []
    for name, state in sorted(view.nodes.items()):
        planned = placement.on_node(name) if placement else []
        nodes.append(
            {
                "node": name,
                "online": state.online,
                "models": sorted(state.models),
                "memory_used_bytes": sum(c.memory_bytes for c in planned),
                "memory_bytes": state.spec.memory_bytes if state.spec else None,
                "planned_occupancy": round(sum(c.occupancy for c in planned), 3),
                "utilisation": state.utilisation,
                "queue_depth": state.queue_depth,
                "following": state.following,
                "http": state.http,
            }
        )
    names = set(placement.models() if placement else ()) | set(
        placement.unplaced if placement else ()
    )
    for state in view.online():
        names |= set(state.models)
    by_alert: dict[str, list[str]] = {}
    for alert in alerts:
        model = alert["model"] if isinstance(alert, dict) else alert.model
        kind = alert["kind"] if isinstance(alert, dict) else alert.kind
        by_alert.setdefault(model, []).append(kind)
    models = []
    for name in sorted(names):
        copies = placement.copies_of(name) if placement else []
        planned_rate = sum(c.rate for c in copies)
        observed = view.rate(name)
        models.append(
            {
                "model": name,
                "copies": len(copies),
                "nodes": sorted(c.node for c in copies),
                "hosted_on": view.hosts(name),
                "backend": ",".join(sorted({c.backend for c in copies})),
                "planned_rate": round(planned_rate, 3),
                "observed_rate": round(observed, 3),
                "utilisation": round(observed / planned_rate, 3) if planned_rate > 0 else None,
                "unplaced": placement.unplaced.get(name) if placement else None,
                "alerts": by_alert.get(name, []),
            }
        )
    bounds = placement.bounds if placement else None
    return {
        "generation": placement.generation if placement else None,
        "nodes_used": len(placement.nodes_used()) if placement else 0,
        "lower_bound": bounds.nodes if bounds else None,
        "nodes": nodes,
        "models": models,
        "alerts": [a if isinstance(a, dict) else a.to_dict() for a in alerts],
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f}"


def render_fleet(document: dict[str, Any]) -> str:
    head = (
        f"placement generation {document['generation']}: {document['nodes_used']} nodes used, "
        f"lower bound {'-' if document['lower_bound'] is None else document['lower_bound']}"
    )
    nodes = _table(
        ["NODE", "STATE", "MODELS", "MEM MiB (used/cap)", "PLANNED", "BUSY", "QUEUE", "FOLLOWS"],
        [
            [
                n["node"],
                "online" if n["online"] else "offline",
                ",".join(n["models"]) or "-",
                f"{_mib(n['memory_used_bytes'])}/{_mib(n['memory_bytes'])}",
                f"{n['planned_occupancy']:.0%}",
                f"{n['utilisation']:.0%}",
                str(n["queue_depth"]),
                str(n["following"]) if n["following"] is not None else "-",
            ]
            for n in document["nodes"]
        ],
    )
    models = _table(
        ["MODEL", "COPIES", "NODES", "BACKEND", "PLANNED/s", "MEASURED/s", "UTIL", "ALERTS"],
        [
            [
                m["model"],
                str(m["copies"]),
                ",".join(m["nodes"]) or "-",
                m["backend"] or "-",
                f"{m['planned_rate']:.2f}",
                f"{m['observed_rate']:.2f}",
                "-" if m["utilisation"] is None else f"{m['utilisation']:.0%}",
                ",".join(m["alerts"]) or (f"unplaced: {m['unplaced']}" if m["unplaced"] else "-"),
            ]
            for m in document["models"]
        ],
    )
    alerts = "\n".join(f"  {a['kind']}: {a['message']}" for a in document["alerts"]) or "  none"
    return f"{head}\n\n{nodes}\n\n{models}\n\nalerts:\n{alerts}\n"
