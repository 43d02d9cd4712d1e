"""What every fault scenario shares: the request stream, its tally, the models.

A scenario drives a real in-process :class:`edge.agent.Agent` with a steady
stream of requests (each one its own task, so a hung request never holds
the stream back) against real ``ferry-cloud`` processes and a real
Mosquitto, injects its fault and reports, per request: answered with a
result, answered with a typed error (:class:`shared.errors.FerryError`, by
code), or LOST: no answer within its deadline plus a margin, or an
exception that is not a typed error.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge.agent import Agent
from shared.errors import FerryError
from tests.support import write_slow_model

#: consecutive requests answered the normal way that say the fault is over
NORMAL_RUN = 5
#: how long past its deadline a request may take before it counts as lost
MARGIN_S = 2.0
#: the per-request deadline of the stream (ms)
DEADLINE_MS = 1000.0
#: compute of the test models (~10-15 ms a run here): requests are really in flight
SLOW = {"size": 384, "layers": 10}


@dataclass
class Record:
    idx: int
    model: str
    sent: float
    done: float | None = None
    outcome: str = "pending"  # ok | error | lost
    code: str = ""
    where: str = ""
    fallback: bool = False
    node: str = ""
    request_id: str = ""
    detail: str = ""


@dataclass
class Result:
    name: str
    sent: int = 0
    ok: int = 0
    ok_cloud: int = 0
    ok_local: int = 0  # answered on the device (a fallback or the policy's choice)
    ok_deferred: int = 0  # a deferral receipt
    errors: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    lost_details: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    problems: list[str] = field(default_factory=list)  # crashes, a scenario that broke
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    skipped: str = ""
    records: list[Record] = field(default_factory=list, repr=False)

    @property
    def failed(self) -> bool:
        return not self.skipped and (self.lost > 0 or bool(self.problems))

    def explain(self) -> str:
        lines = [
            f"{self.name}: sent {self.sent}, ok {self.ok}, errors {dict(self.errors)}, "
            f"lost {self.lost}, time to normal {self.recovery_s}"
        ]
        lines += [f"  LOST {d}" for d in self.lost_details[:20]]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def cloud_normal(r: Record) -> bool:
    """Answered by a cloud node, as before the fault."""
    return r.outcome == "ok" and r.where.startswith("cloud")


class Stream:
    """A steady stream of requests through ``agent``, cycling over ``models``."""

    def __init__(
        self,
        agent: Agent,
        models: list[str],
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        rate_hz: float = 20.0,
        deadline_ms: float = DEADLINE_MS,
        deferrable: bool = False,
        normal: Callable[[Record], bool] = cloud_normal,
    ) -> None:
        self.agent, self.models, self.inputs = agent, models, inputs
        self.rate_hz, self.deadline_ms, self.deferrable = rate_hz, deadline_ms, deferrable
        self.normal = normal
        self.records: list[Record] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._pump: asyncio.Task[None] | None = None

    # ---- sending -----------------------------------------------------------------
    def start(self) -> None:
        self._pump = asyncio.create_task(self._run())

    async def _run(self) -> None:
        period = 1.0 / self.rate_hz
        next_at = time.monotonic()
        i = 0
        while True:
            self.fire(self.models[i % len(self.models)])
            i += 1
            next_at += period
            now = time.monotonic()
            if next_at < now - 1.0:  # the loop was held up: go on, do not burst to catch up
                next_at = now
            await asyncio.sleep(max(0.0, next_at - now))

    def fire(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray] | None = None,
        deadline_ms: float | None = None,
    ) -> Record:
        """Send one request now (the pump's, or a scenario's extra ones)."""
        record = Record(len(self.records), model, time.monotonic())
        self.records.append(record)
        deadline_ms = deadline_ms or self.deadline_ms
        task = asyncio.create_task(self._one(record, inputs or self.inputs[model], deadline_ms))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return record

    async def _one(
        self, record: Record, inputs: Mapping[str, np.ndarray], deadline_ms: float
    ) -> None:
        call = asyncio.ensure_future(
            self.agent.infer(
                record.model, dict(inputs), deadline_ms=deadline_ms, deferrable=self.deferrable
            )
        )
        limit = deadline_ms / 1000.0 + MARGIN_S
        done, _ = await asyncio.wait({call}, timeout=limit)
        record.done = time.monotonic()
        if not done:
            call.cancel()
            record.outcome = "lost"
            record.detail = f"no answer within {limit:.1f} s"
            return
        exc = call.exception()
        if isinstance(exc, FerryError):
            record.outcome, record.code, record.detail = "error", exc.code.value, exc.message
        elif exc is not None:
            record.outcome = "lost"
            record.detail = f"untyped {type(exc).__name__}: {exc}"
        else:
            p = call.result().parameters
            record.outcome = "ok"
            record.where = str(p.get("where", ""))
            record.fallback = bool(p.get("fallback", False))
            record.node = str(p.get("node", ""))
            record.request_id = str(p.get("request_id", ""))

    async def stop(self) -> None:
        """Stop sending and wait for every request to be answered (or lost)."""
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- reading it ---------------------------------------------------------------
    def recovery(
        self, after: float, models: Iterable[str] | None = None, k: int = NORMAL_RUN
    ) -> float | None:
        """Seconds from ``after`` to the first of ``k`` requests in a row (by send order,
        sent at or after it) answered the normal way; None while not (yet) so."""
        wanted = set(models) if models is not None else None
        run = 0
        recs = [
            r for r in self.records if r.sent >= after and (wanted is None or r.model in wanted)
        ]
        for j, r in enumerate(recs):
            if r.outcome == "pending":
                return None
            run = run + 1 if self.normal(r) else 0
            if run == k:
                return max(0.0, recs[j - k + 1].sent - after)
        return None

    async def settle(
        self, after: float, timeout: float, models: Iterable[str] | None = None
    ) -> float | None:
        """Wait (at most ``timeout`` s) until :meth:`recovery` has an answer."""
        models = list(models) if models is not None else None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.recovery(after, models)
            if found is not None:
                return found
            await asyncio.sleep(0.05)
        return self.recovery(after, models)

    def tally(self, name: str) -> Result:
        res = Result(name, records=self.records)
        for r in self.records:
            res.sent += 1
            if r.outcome == "ok":
                res.ok += 1
                if r.where.startswith("cloud"):
                    res.ok_cloud += 1
                elif r.where == "deferred":
                    res.ok_deferred += 1
                else:
                    res.ok_local += 1
            elif r.outcome == "error":
                res.errors[r.code] += 1
            else:
                res.lost += 1
                res.lost_details.append(
                    f"#{r.idx} {r.model} sent at +{r.sent - self.t0:.2f}s: {r.detail}"
                )
        return res

    @property
    def t0(self) -> float:
        return self.records[0].sent if self.records else 0.0


# ---- models and configuration -------------------------------------------------------


def build_repositories(root: Path, *, cloud_extra: Iterable[str] = ()) -> tuple[Path, Path]:
    """A cloud repository (lin, solo and ``cloud_extra``) and a local one (lin-local)."""
    cloud, local = root / "cloud-repo", root / "local-repo"
    for name in ("lin", "solo", *cloud_extra):
        write_slow_model(cloud / name / "1" / "model.onnx", **SLOW)
    write_slow_model(local / "lin-local" / "1" / "model.onnx", **SLOW)
    return cloud, local


#: lin offloads whenever it can and falls back to its local variant; solo is cloud-only,
#: so what the cloud says reaches the app as a typed error.
MODELS = (
    '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\nmode = "cloud"\n'
    '[models.solo]\ncloud = "solo"\n'
)
X = {"x": np.ones((1, 4), np.float32)}


def agent_toml(
    folder: Path,
    local_repo: Path,
    *,
    http: str | None = None,
    mqtt: str | None = None,
    models: str = MODELS,
    state_dir: Path | None = None,
    extra: str = "",
) -> Path:
    cloud = (
        "[cloud]\n"
        + (f'http = "{http}"\n' if http else "")
        + (f'mqtt = "{mqtt}"\n' if mqtt else "")
    )
    text = (
        f'repository = "{local_repo}"\nstate_dir = "{state_dir or folder / "state"}"\n'
        f'device = "raspberry-pi-4b"\nprobe_interval_s = 0.5\n{extra}\n{cloud}\n'
        f"[policy]\ndeadline_ms = {DEADLINE_MS:g}\n{models}\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "agent.toml"
    path.write_text(text)
    return path


def nodes_served(stream: Stream, after: float) -> Counter[str]:
    return Counter(r.node for r in stream.records if r.sent >= after and r.node)


def fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"
