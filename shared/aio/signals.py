"""SIGTERM and SIGINT for the three long-running commands (node, agent, controller).

The first asks for a graceful stop; a second one during it is said in the log
(it had been swallowed without a word, so an operator pressing Ctrl-C again saw
nothing happen) and the stop goes on: it is bounded by the process's own grace.
"""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger(__name__)


def stop_on_signals(stop: asyncio.Event, grace: str) -> None:
    """Set ``stop`` on SIGTERM or SIGINT; ``grace`` says how long a stop may take."""
    loop = asyncio.get_running_loop()

    def asked(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s: already stopping (%s)", sig.name, grace)
            return
        log.info("%s: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, asked, sig)
