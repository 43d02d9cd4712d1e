"""``ferry-cloud``: serve a model repository, or work on model files."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from shared.errors import FerryError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry-cloud", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model repository over HTTP (V2) and MQTT")
    serve.add_argument("--repository", type=Path, help="model repository folder")
    serve.add_argument("--config", type=Path, help="cloud.toml")
    serve.add_argument("--http-host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--http-port", type=int, help="HTTP port (0: any free port)")
    serve.add_argument("--no-http", action="store_true", help="serve MQTT only")
    serve.add_argument("--mqtt", metavar="URL", help="broker, e.g. mqtt://127.0.0.1:1883")
    serve.add_argument("--node", help="node name (default: host name)")
    serve.add_argument(
        "--models",
        help='comma-separated models to load (default: all; "" loads none, for the load API)',
    )
    serve.add_argument("--tokens-file", type=Path, help="bearer tokens, one per line")
    serve.add_argument(
        "--controller",
        action="store_true",
        help="follow the fleet controller's placement (needs --mqtt); loads nothing by itself",
    )
    from cloud.broker_auth import add_auth_command
    from cloud.cli_model import add_model_commands
    from cloud.cli_tune import add_tune_command
    from cloud.controller.cli import add_fleet_commands

    add_model_commands(sub)
    add_auth_command(sub)
    add_fleet_commands(sub)
    add_tune_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command in ("controller", "fleet"):
            from cloud.controller.cli import run_fleet_command

            return run_fleet_command(args)
        if args.command == "tune":
            from cloud.cli_tune import run_tune_command

            return run_tune_command(args)
        if args.command == "auth":
            from cloud.broker_auth import run_auth_command

            return run_auth_command(args)
        from cloud.cli_model import run_model_command

        return run_model_command(args)
    except FerryError as exc:
        print(f"ferry-cloud: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from cloud.config import load_config
    from cloud.server import serve

    overrides = {
        # (absolute: a relative path in the file is read from the file's folder, one given
        #  here from the working directory)
        "repository": str(args.repository.resolve()) if args.repository else None,
        "http.host": args.http_host,
        "http.port": args.http_port,
        "http.enabled": False if args.no_http else None,
        "http.tokens_file": str(args.tokens_file.resolve()) if args.tokens_file else None,
        "mqtt.url": args.mqtt,
        "node": args.node,
        # ("" loads none, as Triton's explicit mode: models come through the load API)
        "models": (
            [m.strip() for m in args.models.split(",") if m.strip()]
            if args.models is not None
            else None
        ),
        "fleet.follow": True if args.controller else None,
    }
    config = load_config(args.config, overrides)
    from shared.aio.threads import favour_the_loop

    favour_the_loop()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    raise SystemExit(main())
