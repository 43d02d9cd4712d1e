"""bench/packing.py part (c): the three-node fleet live, on this machine.

A controller and three nodes (real Mosquitto, the example repository's real
models plus a tiny linear one), clients over HTTP (any node) and MQTT for
``duration_s``; one node is killed with SIGKILL a third of the way in and a
fourth joins at two thirds.  Reported: requests answered (target: all),
share within the latency objective per model, re-placement time.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fleet_lab import (  # noqa: E402
    LAB_MODELS,
    FleetWatch,
    HttpClient,
    MqttClient,
    build_lab_repository,
    start_controller,
    start_node,
)
from tests.support import Broker  # noqa: E402

SLO_MS = 1000.0
MODELS = [m[0] for m in LAB_MODELS]


def run_live(duration_s: float = 45.0) -> tuple[bool, list[str]]:
    """(all targets met, printed lines)."""
    lines: list[str] = []
    example = ROOT / "examples" / "repository"
    if not (example / "orientation" / "1" / "model.onnx").is_file():
        return False, ["(c) live: examples/repository missing: run scripts/setup.sh"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        repository = build_lab_repository(folder / "repo", example, slo_ms=SLO_MS)
        broker = Broker(folder / "broker")
        broker.start()
        watch = FleetWatch(broker)
        controller = start_controller(repository, broker)
        nodes = {n: start_node(repository, broker, folder, n) for n in ("n1", "n2", "n3")}
        clients: list[HttpClient | MqttClient] = []
        replaced_s = None
        try:
            watch.wait("all placed", lambda: all(watch.view.hosts(m) for m in MODELS), 90)
            clients = [
                HttpClient(nodes, MODELS, period_s=0.05),
                MqttClient(broker, MODELS, period_s=0.05),
            ]
            for c in clients:
                c.start()
            time.sleep(duration_s / 3)
            # the node that is the only home of the most models: its death must re-place
            victim = max(
                sorted(nodes), key=lambda n: sum(watch.hosts(m) == [n] for m in MODELS)
            )
            orphans = [m for m in MODELS if watch.hosts(m) == [victim]]
            generation = watch.generation()
            nodes[victim].kill()
            clients[0].down.add(victim)  # type: ignore[union-attr]
            replaced_s = watch.wait(
                "re-placed",
                lambda: watch.view.placement.generation != generation
                and all(any(h != victim for h in watch.view.hosts(m)) for m in MODELS),
                30,
            )
            lines.append(f"    killed {victim}, sole home of {orphans or 'no model'}")
            time.sleep(duration_s / 3)
            nodes["n4"] = start_node(repository, broker, folder, "n4")
            time.sleep(duration_s / 3)
            joined = [m for m in MODELS if "n4" in watch.view.hosts(m)]
            lines.append(f"    n4 joined and hosts {joined or 'nothing yet'}")
        finally:
            for c in clients:
                c.stop.set()
            for c in clients:
                c.join(60)
            controller.terminate()
            for node in nodes.values():
                node.terminate()
            watch.close()
            broker.stop()
    ok = True
    lines.append(
        f"(c) live fleet, {duration_s:.0f} s, SLO {SLO_MS:.0f} ms, node killed + node joined"
    )
    took = "never" if replaced_s is None else f"in {replaced_s:.1f} s"
    lines.append(f"    re-placed the dead node's models {took} (target <= 10 s)")
    if replaced_s is None or replaced_s > 10:
        ok = False
        lines.append("    MISS: re-placement took over 10 s")
    for c in clients:
        kind = "HTTP" if isinstance(c, HttpClient) else "MQTT"
        s = c.stats
        worst = min(
            (sum(v <= SLO_MS / 1000 for v in vs) / len(vs), m) for m, vs in s.latencies.items()
        )
        lines.append(
            f"    {kind}: sent {s.sent}, answered {s.answered}, lost {s.lost}, retries "
            f"{s.retries}; within SLO {s.within(SLO_MS / 1000):.1%} "
            f"(worst model {worst[1]} {worst[0]:.1%})"
        )
        if s.lost or s.answered != s.sent:
            ok = False
            lines.append(f"    MISS: {kind} requests not all answered: {s.errors[:3]}")
    return ok, lines


if __name__ == "__main__":
    good, out = run_live()
    print("\n".join(out))
    raise SystemExit(0 if good else 1)
