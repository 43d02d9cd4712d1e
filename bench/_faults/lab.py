"""The processes of a scenario, and the driver that runs its fault under the stream."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench._faults.harness import Record, Result, Stream, cloud_normal
from edge.agent import Agent
from tests.support import Broker, ServerProcess, cloud_server


class LogTap(logging.Handler):
    """Keeps the agent's warnings and errors (in-process) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [
            f"{r.name}: {r.getMessage()}" + (" (with traceback)" if r.exc_info else "")
            for r in self.records
            if r.levelno >= logging.ERROR
        ]


class Lab:
    """The processes of one scenario: a broker, cloud nodes; checks none died unasked."""

    def __init__(self, workdir: Path, quick: bool) -> None:
        self.workdir = workdir
        self.quick = quick
        workdir.mkdir(parents=True, exist_ok=True)
        self.broker: Broker | None = None
        self.nodes: dict[str, ServerProcess] = {}
        self.killed: set[str] = set()  # nodes the scenario took down on purpose
        self.broker_down = False
        self.retired: list[tuple[str, ServerProcess]] = []  # earlier incarnations
        self._broker_dir = workdir

    def t(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    async def start_broker(self, *, persistence: bool = True) -> Broker:
        """Mosquitto with the project's config, its state in a folder it can write: as
        root it drops to its own user, which cannot enter a 0700 folder (mkdtemp's,
        pytest's), and would then lose its sessions on a restart without a word.
        ``persistence=False`` turns that off on purpose (a broker that forgets)."""
        self._broker_dir = Path(tempfile.mkdtemp(prefix="ferry-fault-broker-"))
        os.chmod(self._broker_dir, 0o755)
        self.broker = Broker(self._broker_dir / "broker")
        if not persistence:
            conf = self.broker.conf
            conf.write_text(conf.read_text().replace("persistence true", "persistence false"))
        await asyncio.to_thread(self.broker.start)
        return self.broker

    async def start_node(self, name: str, repository: Path, *extra: str) -> ServerProcess:
        args = ["--node", name, *extra]
        if self.broker is not None and "--mqtt" not in extra:
            args += ["--mqtt", self.broker.url]
        node = cloud_server(repository, *args)
        if name in self.nodes:
            self.retired.append((name, self.nodes[name]))
        await asyncio.to_thread(node.start)
        self.nodes[name] = node
        self.killed.discard(name)
        return node

    def problems(self) -> list[str]:
        out = []
        for name, node in self.nodes.items():
            proc = node.proc
            if name not in self.killed and proc is not None and proc.poll() is not None:
                tail = "".join(node.lines[-15:])
                out.append(f"node {name} exited unexpectedly (status {proc.returncode}):\n{tail}")
        b = self.broker
        if b is not None and not self.broker_down and (b.proc is None or b.proc.poll() is not None):
            out.append("the broker exited unexpectedly")
        return out

    def node_notes(self) -> list[str]:
        notes = []
        for name, node in [*self.retired, *self.nodes.items()]:
            text = node.output()
            tracebacks = text.count("Traceback (most recent call last)")
            if tracebacks:
                first = text[text.index("Traceback") :].splitlines()
                where = next(
                    (ln for ln in reversed(first[:40]) if ln and not ln.startswith(" ")), ""
                )
                notes.append(f"node {name} logged {tracebacks} traceback(s), e.g. {where.strip()}")
        return notes

    async def close(self) -> None:
        def down() -> None:
            for node in [*self.nodes.values(), *(n for _, n in self.retired)]:
                if node.proc is not None and node.proc.poll() is None:
                    node.terminate(timeout=5.0)
            if self.broker is not None:
                self.broker.stop()
                log = self.broker.workdir / "mosquitto.log"
                if log.exists():
                    shutil.copy(log, self.workdir / "mosquitto.log")
                shutil.rmtree(self._broker_dir, ignore_errors=True)

        await asyncio.to_thread(down)


def finish(stream: Stream, lab: Lab, tap: LogTap, name: str, **extra: Any) -> Result:
    res = stream.tally(name)
    res.problems += lab.problems()
    res.notes += lab.node_notes()
    errors = tap.errors()
    if errors:
        res.notes.append(f"the agent logged {len(errors)} error(s), e.g. {errors[0][:200]}")
    for key, value in extra.items():
        setattr(res, key, value)
    return res


class ScenarioError(Exception):
    """The scenario could not do what it set out to."""


class Skip(Exception):
    """This machine cannot run the scenario (say why); not a finding about Ferry."""


Body = Callable[[Stream, Agent, list[str]], Any]


async def drive(
    lab: Lab,
    name: str,
    config: Path,
    models: list[str],
    inputs: Mapping[str, Mapping[str, np.ndarray]],
    body: Body,
    *,
    rate_hz: float = 20.0,
    deferrable: bool = False,
    normal: Callable[[Record], bool] = cloud_normal,
    warm_models: Iterable[str] | None = None,
) -> Result:
    """Run ``body`` (the fault, returning the time to normal) under a steady stream.

    The stream must first run normally (``NORMAL_RUN`` requests in a row);
    whatever happens, every request is waited for and tallied, and a body
    that raises is reported as a problem of the scenario.
    """
    from edge.config import load_agent_config

    tap = LogTap()
    root = logging.getLogger()
    root.addHandler(tap)
    notes: list[str] = []
    problems: list[str] = []
    recovery: float | None = None
    stream: Stream | None = None
    try:
        async with Agent(load_agent_config(config)) as agent:
            stream = Stream(
                agent, models, inputs, rate_hz=rate_hz, deferrable=deferrable, normal=normal
            )
            began = time.monotonic()
            stream.start()
            try:
                warm = await stream.settle(began, 10.0, warm_models)
                if warm is None:
                    raise ScenarioError("the stream never ran normally before the fault")
                recovery = await body(stream, agent, notes)
                if recovery is None:
                    problems.append("requests did not return to normal after the fault")
            except ScenarioError as exc:
                problems.append(f"scenario could not run: {exc}")
            except Exception as exc:  # the report says what broke; the tally still counts
                problems.append(f"scenario crashed: {exc!r}\n{traceback.format_exc()}")
            finally:
                await stream.stop()
    finally:
        root.removeHandler(tap)
    if stream is None:
        raise ScenarioError("the agent did not start")
    res = finish(stream, lab, tap, name, recovery_s=recovery)
    res.problems += problems
    res.notes = notes + res.notes
    return res
