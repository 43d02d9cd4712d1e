"""``ferry-edge``: run the agent, emulate a link, evaluate a policy, build the compiled core."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from shared.aio.signals import stop_on_signals
from shared.errors import FerryError

COMMANDS = ("run", "emulate-link", "evaluate", "profile", "build-native")


#: how long a stopping agent lets the requests in flight finish
DRAIN_S = 10.0


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI; given ``argv``, only the command it names gets its options.

    The options of ``evaluate`` and ``emulate-link`` live beside their code
    (the replay tools, the link emulator): an agent started with ``run``
    must not import those to parse its own two options (they cost it start-up
    time and resident memory on a device).
    """
    wanted = next((a for a in argv if a in COMMANDS), None) if argv is not None else None
    parser = argparse.ArgumentParser(prog="ferry-edge", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the edge agent")
    run.add_argument("--config", type=Path, required=True, help="agent.toml")
    run.add_argument("--api-port", type=int, help="override api.port (0: any free port)")
    if wanted in (None, "emulate-link"):
        from edge.netem.linkemu import add_emulate_link_command

        add_emulate_link_command(sub)
    else:
        sub.add_parser("emulate-link")
    ev = sub.add_parser(
        "evaluate", help="replay a workload through a link trace: policy vs baselines vs oracle"
    )
    if wanted in (None, "evaluate"):
        from edge.evaluation.cli import add_evaluate_arguments

        add_evaluate_arguments(ev)
    pr = sub.add_parser("profile", help="measure compute profiles on the real runtimes")
    pr.add_argument("--repository", type=Path, required=True)
    pr.add_argument("--local-model", required=True)
    pr.add_argument("--cloud-model", required=True)
    pr.add_argument("--cloud-repository", type=Path, help="default: --repository")
    pr.add_argument("--runs", type=int, default=100)
    pr.add_argument("--threads", type=int, default=1, help="intra-op threads for the local model")
    pr.add_argument("--out", type=Path, required=True)
    bn = sub.add_parser(
        "build-native", help="compile the decision core with mypyc (needs a C compiler)"
    )
    if wanted in (None, "build-native"):
        from edge.native import add_arguments

        add_arguments(bn)
    return parser


async def _run(config_path: Path, api_port: int | None) -> int:
    from dataclasses import replace

    from edge.agent import Agent
    from edge.config import load_agent_config
    from edge.core import NATIVE
    from edge.http_front import start_local_api
    from shared.aio.threads import favour_the_loop
    from shared.errors import ConfigError
    from shared.tokens import TokensFile, follow_tokens

    favour_the_loop()

    config = load_agent_config(config_path)
    if api_port is not None:
        if not 0 <= api_port <= 65535:
            raise ConfigError(f"--api-port: expected a port from 0 to 65535, got {api_port}")
        config = replace(config, api_port=api_port)
    tokens_file = None
    if config.api_tokens_file:
        try:
            tokens_file = TokensFile(config.api_tokens_file)
        except ConfigError as exc:
            raise ConfigError(f"{config_path}: key 'api.tokens_file': {exc.message}") from None
    agent = Agent(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_on_signals(stop, f"at most {DRAIN_S + 2:g} s")
    # SIGHUP (a closed terminal, an operator's "reload"): re-read the config now; by
    # default it killed the agent on the spot, requests in flight and estimates lost.
    loop.add_signal_handler(signal.SIGHUP, agent.reload_soon)
    await agent.start()
    server = None
    parts = [
        f"local={','.join(agent.local.names()) or '-'}",
        f"transports={','.join(agent.transports) or '-'}",
        f"core={NATIVE.split()[0].rstrip(':')}",
    ]
    if config.api_port is not None:
        try:
            server = await start_local_api(
                agent,
                config.api_host,
                config.api_port,
                tokens=tokens_file.tokens if tokens_file is not None else None,
                max_inflight_bytes=config.api_max_inflight_bytes,
            )
        except FerryError:
            await agent.stop()
            raise
        parts.append(f"http=http://{config.api_host}:{server.port}")
    following = None
    if server is not None and tokens_file is not None:
        api = server.app
        following = asyncio.create_task(
            follow_tokens(tokens_file, lambda tokens: setattr(api, "tokens", tokens))
        )
    print("ferry-edge ready " + " ".join(parts), flush=True)
    await stop.wait()
    if following is not None:
        following.cancel()
    # The agent drains (new requests refused with shutting_down, those in flight given
    # DRAIN_S, then answered with an error) while the front stays open to write every
    # answer: a 5 s front drain before it had cut requests still running with no answer.
    if server is not None:
        server.stop_listening()
    stopping = asyncio.ensure_future(agent.stop(drain_s=DRAIN_S))
    if server is not None:
        await server.drain(time.monotonic() + DRAIN_S + 2.0)
        await server.close()
    await stopping
    print("ferry-edge stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "run":
            # A device counts its RSS: one malloc arena (the agent's few threads each
            # held their own freed memory), set before any thread starts
            from shared.heap import limit_arenas

            limit_arenas(1)
            return asyncio.run(_run(args.config, args.api_port))
        if args.command == "evaluate":
            from edge.evaluation.cli import run_evaluate

            return run_evaluate(args)
        if args.command == "profile":
            from edge.evaluation.cli import run_profile

            return run_profile(args)
        if args.command == "build-native":
            from edge.native import run

            return run(args)
        if args.command == "emulate-link":
            from edge.netem.linkemu import run_emulate_link

            return run_emulate_link(args)
    except FerryError as exc:
        print(f"ferry-edge: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
