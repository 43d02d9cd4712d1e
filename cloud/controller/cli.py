"""``ferry-cloud controller`` and ``ferry-cloud fleet``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_fleet_commands(sub: Any) -> None:
    controller = sub.add_parser(
        "controller", help="place models on the nodes following it (publishes the placement)"
    )
    _broker_arguments(controller)
    controller.add_argument("--repository", required=True, type=Path, help="model repository")
    controller.add_argument("--profiles", type=Path, help="profiles.json from ferry-cloud tune")
    controller.add_argument(
        "--interval-s", type=float, default=10.0, help="re-placement period when rates move"
    )
    controller.add_argument("--http-host", default="127.0.0.1", help="/metrics and /fleet bind")
    controller.add_argument(
        "--http-port",
        type=int,
        default=8001,
        help="/metrics and /fleet port (default 8001; -1: none)",
    )
    controller.add_argument(
        "--burst-cv",
        type=float,
        default=1.0,
        help="coefficient of variation of arrivals to plan headroom for (1: Poisson)",
    )
    controller.add_argument("--alert-window-s", type=float, default=60.0)
    controller.add_argument(
        "--idle-unload-s",
        type=float,
        default=300.0,
        help="unload a min_copies = 0 model no request asked for in this long (default 300)",
    )
    fleet = sub.add_parser("fleet", help="show nodes, models, copies, rates and alerts")
    _broker_arguments(fleet)
    fleet.add_argument("--wait-s", type=float, default=1.5, help="time to collect retained state")
    fleet.add_argument("--json", action="store_true", help="print the document as JSON")


def _broker_arguments(parser: Any) -> None:
    parser.add_argument("--broker", metavar="URL", help="mqtt://host:port (or [mqtt] url)")
    parser.add_argument(
        "--config",
        type=Path,
        help="a TOML file whose [mqtt] table says how to reach the broker, with a node's "
        "keys (url, username, password_file, ca_file, cert_file, key_file, tls_insecure, "
        "client_id, keepalive_s); give it a user of its own: a node's name would knock "
        "that node off a locked broker",
    )


def _mqtt_settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The broker and how to reach it: ``--config``'s [mqtt] table, ``--broker`` over
    its url (a password stays in a file, out of the process list)."""
    from cloud.config import _SCHEMA, parse_mqtt_section
    from shared.configcheck import check_keys, read_toml
    from shared.errors import ConfigError

    table: dict[str, Any] = {}
    source, base = "command line", Path.cwd()
    if args.config is not None:
        source, base = str(args.config), args.config.parent
        table = dict(read_toml(args.config).get("mqtt", {}))
        check_keys({"mqtt": table}, {"mqtt": _SCHEMA["mqtt"]}, source)
    if args.broker:
        table["url"] = args.broker
    settings = parse_mqtt_section(table, source, base)
    if settings is None:
        raise ConfigError(f"{source}: a broker is needed: --broker URL, or [mqtt] url")
    return settings, table


def run_fleet_command(args: argparse.Namespace) -> int:
    if args.command == "controller":
        return _controller(args)
    return _fleet(args)


def _controller(args: argparse.Namespace) -> int:
    from cloud.controller.alerts import AlertSettings
    from cloud.controller.catalogue import read_catalogue
    from cloud.controller.core import ControllerCore, ControllerSettings
    from cloud.controller.service import ControllerOptions, run_controller
    from cloud.placement.packing import Headroom
    from shared.errors import ConfigError
    from shared.repository import ModelRepository

    for flag, value, zero_ok in (
        ("--interval-s", args.interval_s, False),
        ("--burst-cv", args.burst_cv, True),
        ("--alert-window-s", args.alert_window_s, False),
        ("--idle-unload-s", args.idle_unload_s, False),
    ):
        if not (0.0 <= value < float("inf")) or (value == 0.0 and not zero_ok):
            least = ">= 0" if zero_ok else "> 0"
            raise ConfigError(f"{flag} must be a finite number {least}, got {value}")
    repository = ModelRepository(args.repository)
    catalogue, problems = read_catalogue(repository)
    profiles = {}
    if args.profiles:
        from cloud.tuning.profiles import load_profiles

        profiles = load_profiles(args.profiles)
        # (a profile is used only for a model of the repository: a typo, or a model
        # since removed, had been taken without a word)
        for name in sorted(set(profiles) - set(catalogue) - set(problems)):
            print(
                f"ferry-cloud controller: {args.profiles}: key 'models.{name}': no such model "
                "in the repository; its profiles are not used",
                file=sys.stderr,
            )
    settings = ControllerSettings(
        interval_s=args.interval_s,
        headroom=Headroom(cv=args.burst_cv),
        alerts=AlertSettings(window_s=args.alert_window_s),
        idle_unload_s=args.idle_unload_s,
    )
    core = ControllerCore(catalogue, profiles, settings)
    for name, why in sorted(problems.items()):
        print(f"ferry-cloud controller: model {name} not placed: {why}", file=sys.stderr)
    mqtt, table = _mqtt_settings(args)
    options = ControllerOptions(
        broker=mqtt.broker,
        **({"client_id": mqtt.client_id} if mqtt.client_id else {}),
        ca_file=mqtt.ca_file,
        cert_file=mqtt.cert_file,
        key_file=mqtt.key_file,
        tls_insecure=mqtt.tls_insecure,
        # (15 s unless set: a standby takes over 1.5 keepalives after the active one died)
        **({"keepalive_s": mqtt.keepalive_s} if "keepalive_s" in table else {}),
        http_host=args.http_host,
        http_port=None if args.http_port < 0 else args.http_port,
        rescan=lambda: read_catalogue(repository),
    )
    return asyncio.run(run_controller(core, options))


def _fleet(args: argparse.Namespace) -> int:
    from cloud.controller.table import fleet_document, render_fleet
    from cloud.fleet.follower import STATUS_PATTERN
    from cloud.fleet.view import FleetView
    from cloud.mqtt_front import new_client
    from shared.errors import ConfigError, EndpointUnavailable
    from shared.mqtt import ALERTS_TOPIC, PLACEMENT_TOPIC, node_from_status_topic
    from shared.mqtt.documents import decode_document

    mqtt, _ = _mqtt_settings(args)
    broker = mqtt.broker
    view = FleetView()
    alerts: list[Any] = []

    def on_message(message: Any) -> None:
        try:
            document = decode_document(message.payload)
        except ConfigError:
            return
        if message.topic == PLACEMENT_TOPIC:
            view.on_placement(document)
        elif message.topic == ALERTS_TOPIC:
            alerts[:] = document if isinstance(document, list) else []
        else:
            node = node_from_status_topic(message.topic)
            if node:
                view.on_status(node, document)

    async def watch() -> None:
        client = new_client(
            broker,
            f"ferry-fleet-{time.monotonic_ns() % 10**9}",
            ca_file=mqtt.ca_file,
            insecure=mqtt.tls_insecure,
            cert_file=mqtt.cert_file,
            key_file=mqtt.key_file,
            keepalive_s=10,
            on_message=on_message,
        )
        client.on_connect = lambda: client.subscribe(STATUS_PATTERN, PLACEMENT_TOPIC, ALERTS_TOPIC)
        try:
            if not await client.start(5.0):
                raise EndpointUnavailable(
                    f"broker {broker.host}:{broker.port} did not accept the connection"
                )
            await asyncio.sleep(args.wait_s)
        finally:
            await client.close()

    asyncio.run(watch())
    document = fleet_document(view, list(alerts))
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_fleet(document), end="")
    return 0
