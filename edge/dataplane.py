"""The edge agent's one dataplane: the live driver of the sans-IO flow.

Both fronts (the local V2 HTTP API and the asyncio Python API) call
:meth:`EdgeDataPlane.infer`.  What to do with a request (decide, offload,
fall back, cascade, defer, learn) is :mod:`edge.core.flow`'s; this module
only carries its actions out: a local run on the runtime's threads, a
transfer over a transport, a row in the deferred store.  Every request gets
exactly one answer: a result (local or cloud), a deferred receipt, or a
typed error, with its provenance in ``parameters``: where it ran,
predicted vs actual latency, estimated energy, bytes moved, and why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import quote

import numpy as np

from edge.core.accounting import batch_rows, provenance, request_bytes
from edge.core.breaker import CircuitBreaker
from edge.core.estimators import Estimators
from edge.core.flow import (
    DEFERRED_SEND_S,
    Action,
    Answer,
    Defer,
    EdgeCore,
    Fail,
    Hedge,
    Offload,
    RequestFlow,
    RunLocal,
)
from edge.core.policy import LOCAL, Decision, ModelPolicy, Policy
from edge.core.scores import confidence
from edge.local import LocalModels
from edge.stats import AgentStats
from edge.transports.base import TransferResult, Transport
from shared import v2
from shared.aio.eager import eager_future, retrieved
from shared.aio.idempotency import (
    IdempotencyCache,
    as_duplicate,
    owned_response,
    response_bytes,
)
from shared.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ShuttingDown,
)
from shared.idempotency import fingerprint, idempotency_key, receipt_id, scoped_key
from shared.messages import InferRequest, InferResponse
from shared.pipeline.classification import requested_classes, top_k
from shared.repository import ModelConfig, triton_model_config, v2_model_metadata
from shared.repository.validation import output_tensor, validated_inputs, validated_outputs
from shared.runtimes.base import Cancel
from shared.tensors import Tensor

T = TypeVar("T")
log = logging.getLogger(__name__)

#: apps' keyed answers kept for their retries: as long as the cloud keeps them by default,
#: and few (an agent's memory is counted in MiB)
ANSWERS_TTL_S = 600.0
ANSWERS_MAX_ENTRIES = 1024
ANSWERS_MAX_BYTES = 8 << 20


class EdgeDataPlane:
    def __init__(
        self,
        *,
        policy: Policy,
        estimators: Estimators,
        local: LocalModels,
        transports: dict[str, Transport],
        breakers: dict[str, CircuitBreaker] | None = None,
        deferrer: Any = None,
        battery: Any = None,
        journal: int = 0,
    ) -> None:
        self.core = EdgeCore(policy, transports, breakers=breakers, journal=journal)
        self.est = estimators
        self.local = local
        self.transports = transports
        self.deferrer = deferrer
        self.battery = battery  # callable -> percent | None
        self.stats = AgentStats()
        self._background: set[asyncio.Task[Any]] = set()  # hedges' late halves
        self._inflight = 0  # requests taken and not yet answered (drain waits on them)
        self._drained: asyncio.Event | None = None
        self._closing = False
        self._breaker_said: dict[str, str] = {}  # transport -> the breaker state last logged
        self._last_failure: dict[str, str] = {}  # transport -> its last failure, for the log
        # Answers to apps' keyed requests, for their retries (bounded: an evicted key
        # only means a late retry runs again, as at the cloud)
        self._answers: IdempotencyCache[InferResponse] = IdempotencyCache(
            ANSWERS_TTL_S, ANSWERS_MAX_ENTRIES, ANSWERS_MAX_BYTES, response_bytes, owned_response
        )

    # ---- the core's state, as the agent and its fronts read it ------------------
    @property
    def policy(self) -> Policy:
        return self.core.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.core.policy = policy  # a request in flight keeps the one it started with

    @property
    def breakers(self) -> dict[str, CircuitBreaker]:
        return self.core.breakers

    @property
    def usage(self) -> Any:
        return self.core.usage

    def connected(self, cloud_model: str | None = None) -> dict[str, bool]:
        """Which transports are up and (as far as the nodes' status says) serve the model."""
        out = {}
        for name, transport in self.transports.items():
            ok = transport.connected
            serves = getattr(transport, "serves", None)
            if ok and cloud_model is not None and serves is not None:
                ok = serves(cloud_model) is not False
            out[name] = ok
        return out

    def _explained(self, error: FerryError, cloud_model: str | None) -> FerryError:
        """The policy reads a transport whose nodes do not serve the model as one without
        a link ("no link"): say which it is, where that is why."""
        if not isinstance(error, ModelNotReady) or cloud_model is None:
            return error
        unserved = [
            name
            for name, t in self.transports.items()
            if t.connected and getattr(t, "serves", lambda _: None)(cloud_model) is False
        ]
        # (and a transport whose cloud answered "no such model": the policy skips it
        # until the cooldown ends, which it also reads as "no link")
        now = time.monotonic()
        absent = {
            name: until - now
            for name, t in self.transports.items()
            if t.connected
            and name not in unserved
            and (until := self.core.missing.get((name, cloud_model), 0.0)) > now
        }
        if not unserved and not absent:
            return error
        said = []
        if unserved:
            said.append(
                f"connected over {', '.join(unserved)}, where no cloud node serves model "
                f"{cloud_model!r} now"
            )
        if absent:
            said.append(
                f"the cloud over {', '.join(absent)} answered that it has no model "
                f"{cloud_model!r} (asked again in {max(absent.values()):.0f} s)"
            )
        return ModelNotReady(f"{error.message}; {'; '.join(said)}", retry_after=error.retry_after)

    def usable(self, now: float, cloud_model: str | None = None) -> dict[str, bool]:
        """Transports a request for ``cloud_model`` may take now."""
        return self.core.usable(now, self.connected(cloud_model), cloud_model)

    def _begin(
        self,
        model: str,
        request: InferRequest,
        now: float,
        *,
        deadline_ms: float | None = None,
        deferrable: bool = False,
        mode: str | None = None,
        cloud_only: bool = False,
        record: bool = True,
        versioned: bool = False,
    ) -> RequestFlow:
        mp = self.core.policy.model_policy(model)
        local_model = None if cloud_only else mp.local_model
        return self.core.begin(
            model,
            now=now,
            in_bytes=request_bytes(request),
            connected=self.connected(mp.cloud_model),
            local_available=local_model is not None and self.local.has(local_model),
            deadline_ms=deadline_ms,
            batch=batch_rows(request),
            local_backlog=self.local.backlog(local_model) if local_model else 0,
            local_cancellable=local_model is not None and self.local.cancellable(local_model),
            battery=self.battery() if self.battery else None,
            deferrable=deferrable,
            mode=mode,
            cloud_only=cloud_only,
            record=record,
            versioned=versioned,
        )

    def decide(
        self, model: str, request: InferRequest, deadline_s: float, mode: str | None = None
    ) -> Decision:
        """What the policy would choose for ``request`` now (no side effects on the link)."""
        now = time.monotonic()
        flow = self._begin(
            model, request, now, deadline_ms=deadline_s * 1000.0, mode=mode, record=False
        )
        return self.core.policy.decide_for(flow.mp, flow.context(now), flow.mode)

    # ---- the app's models (both fronts: the local V2 API and the Python API) ----
    def models(self) -> list[str]:
        """The names an app may ask for: the policy file's and the local models' (each of
        which is served under its own name too)."""
        return sorted({*self.core.policy.config.models, *self.local.names()})

    def _known(self, name: str) -> None:
        """ModelNotFound unless ``name`` is one of the policy's models or a local model.

        Any other name would be offloaded under its own name, reported ready, and a
        deferrable request for it kept pending until its time to live: a typo must be
        a 404 here, as the cloud would answer it."""
        if name not in self.core.policy.config.models and not self.local.has(name):
            raise ModelNotFound(
                f"unknown model {name!r}: not in the agent's [models], and not a local model "
                "it loaded (the agent loads the local variants its [models] name: add "
                f"[models.{_toml_key(name)}] with local = {json.dumps(name)} to serve that "
                "folder)"
            )

    def resolve(self, name: str, version: str | None = None) -> Any:
        """The loaded local variant serving ``name`` (checked against ``version``), or None
        for a model served by the cloud only; ModelNotFound for neither."""
        self._known(name)
        mp = self.core.policy.model_policy(name)
        model = self._local_variant(mp)
        if model is None and (mp.cloud_model is None or not self.transports):
            raise ModelNotFound(f"unknown model {name!r}")
        if version not in (None, "") and model is not None and version != str(model.version):
            if not self._cloud_version(name, version):
                raise ModelNotFound(
                    f"model {name!r}: the agent serves its version {model.version} only "
                    f"(the newest its local folder's version policy selects), not {version}"
                )
            return None  # another version than the local one: the cloud's to serve
        return model

    def _cloud_version(self, name: str, version: str | None) -> bool:
        """Whether ``version`` of ``name`` is the cloud's to serve: a cloud-only model's
        versions are the cloud's (it answers a 404 for one it lacks), and so is any
        version but the local variant's where the model has a cloud route."""
        if version in (None, ""):
            return False
        mp = self.core.policy.model_policy(name)
        if mp.cloud_model is None or not self.transports or mp.mode == "local":
            return False
        local = self._local_variant(mp)
        return local is None or str(local.version) != version

    def _local_variant(self, mp: Any) -> Any:
        """``mp``'s local variant where it is loaded, else None."""
        if mp.local_model and self.local.has(mp.local_model):
            return self.local.get(mp.local_model)
        return None

    async def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """V2 metadata: the local variant's, or the cloud's for a cloud-only model."""
        model = self.resolve(name, version)
        if model is None:
            return await self._cloud_json(name, "metadata", version)
        return v2_model_metadata(name, model.config, [str(model.version)])

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton-shaped configuration, from the same source as the metadata."""
        model = self.resolve(name, version)
        if model is None:
            return await self._cloud_json(name, "config", version)
        return {**triton_model_config(model.config), "name": name}

    async def ready(self, name: str, version: str | None = None) -> bool:
        """:meth:`model_ready`, and a version the cloud serves asked of the cloud itself
        (over HTTP; over MQTT alone, its nodes' status names models, not versions)."""
        if not self.model_ready(name, version):
            return False
        http = self.transports.get("http")
        if not self._cloud_version(name, version) or http is None:
            return True
        cloud_model = self.core.policy.model_policy(name).cloud_model
        try:
            await http.get_json(  # type: ignore[attr-defined]
                f"/v2/models/{quote(cloud_model or '', safe='')}/versions/"
                f"{quote(version or '', safe='')}/ready",
                time.monotonic() + 5.0,
            )
        except FerryError:
            return False
        return True

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """A local variant is loaded, or (served by the cloud) a transport could take it
        now: what routing knows, without asking the cloud (see :meth:`ready`)."""
        try:
            model = self.resolve(name, version)
        except FerryError:
            return False
        if model is not None:
            return True
        mp = self.core.policy.model_policy(name)
        usable = self.usable(time.monotonic(), mp.cloud_model)
        return any(usable.get(t, False) for t in mp.transports)  # (those it may take)

    def repository_index(self) -> list[dict[str, str]]:
        entries = []
        for name in self.models():
            try:
                model, ready = self.resolve(name), True
            except FerryError:
                model, ready = None, False
            entries.append(
                {
                    "name": name,
                    "version": str(model.version) if model is not None else "",
                    "state": "READY" if ready else "UNAVAILABLE",
                    "reason": "" if ready else "no local variant and no cloud endpoint",
                }
            )
        return entries

    def model_stats(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics shape (plus where each request ran and its errors)."""
        if name is None:
            names = sorted(set(self.models()) | set(self.stats.names()))
        else:
            self.resolve(name, version)
            names = [name]
        return {"model_stats": [self.stats.to_triton(n, self._version(n)) for n in names]}

    def _version(self, name: str) -> str:
        """The local variant's version ("" for a model the cloud alone serves)."""
        try:
            model = self.resolve(name)
        except FerryError:
            return ""
        return str(model.version) if model is not None else ""

    def _items(self, name: str, request: InferRequest) -> int:
        """Batch items of a request, where the model batches (its local variant says)."""
        try:
            model = self.resolve(name)
        except FerryError:
            return 1
        if model is None or not model.config.max_batch_size or not request.inputs:
            return 1
        shape = request.inputs[0].data.shape
        return int(shape[0]) if shape else 1

    async def _cloud_json(self, name: str, what: str, version: str | None = None) -> dict[str, Any]:
        """Metadata or config of a model (a version) the cloud serves, from its own V2 API."""
        mp = self.core.policy.model_policy(name)
        http = self.transports.get("http")
        if http is None or mp.cloud_model is None:
            raise ModelNotReady(
                f"model {name!r} runs in the cloud only and no HTTP endpoint is configured "
                f"to read its {what} from"
            )
        at = f"/versions/{quote(version, safe='')}" if version else ""
        doc = await http.get_json(  # type: ignore[attr-defined]
            f"/v2/models/{quote(mp.cloud_model, safe='')}{at}{'/config' if what == 'config' else ''}",
            time.monotonic() + 5.0,
        )
        doc["name"] = name
        return doc

    # ---- serving --------------------------------------------------------------
    async def infer(
        self,
        model: str,
        request: InferRequest,
        *,
        deadline_ms: float | None = None,
        priority: int | None = None,
        deferrable: bool = False,
        principal: str = "",
    ) -> InferResponse:
        """Answer one app's request.  ``principal`` names the app (its token's, over the
        local API; "" without tokens): its idempotency keys and deferrals are its own."""
        if self._closing:
            raise ShuttingDown("the agent is stopping: not taking new requests")
        if deadline_ms is not None and (
            isinstance(deadline_ms, bool)
            or not isinstance(deadline_ms, int | float | np.integer | np.floating)
            or not 0 < deadline_ms < math.inf  # NaN too
        ):
            raise InvalidInput(f"deadline_ms must be a positive number, got {deadline_ms!r}")
        if priority is not None:  # (checked wherever it runs: the cloud refused a bad one)
            v2.checked_priority(priority)
        if not isinstance(deferrable, bool | np.bool_) and not (
            isinstance(deferrable, int | np.integer) and deferrable in (0, 1)
        ):  # ("no" had been read as true)
            raise InvalidInput(f"deferrable must be true or false, got {deferrable!r}")
        if deadline_ms is not None:
            deadline_ms = float(deadline_ms)  # (numpy scalars too: the core takes floats)
        self._inflight += 1
        try:
            return await self._infer(
                model, request, deadline_ms, priority, bool(deferrable), principal
            )
        except EndpointUnavailable:
            if self._closing:  # the agent closed its own transport under it, not the cloud
                raise ShuttingDown(
                    "the agent stopped before this request's answer came back"
                ) from None
            raise
        finally:
            self._left()

    @property
    def inflight(self) -> int:
        """Requests taken and not yet answered."""
        return self._inflight

    async def _by_deadline(
        self,
        work: Coroutine[Any, Any, T],
        deadline: float,
        late: Callable[[], str],
        background: bool = True,
    ) -> T:
        """``work``'s outcome by the request's deadline, else 504 then.

        Where no option was expected to make the deadline, the fastest still runs
        (its answer may come in time, and what it teaches serves the next), and a
        prediction may be wrong: the app had waited for it however long it took (a
        2 s deadline answered 200 after 30 s over a crawling link).  What is under
        way goes on in the background, within its own give-up time, and the flow
        learns from it; its answer is dropped (``background``: counted for drain
        here; a keyed run counts itself, and stays in the answers' cache for a retry
        to join).

        One future, set by the work as it ends or by a timer at the deadline: the
        caller wakes as soon as from awaiting the work (wait_for and shield had cost
        ~60 us a request, a loop turn and their futures)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[T] = loop.create_future()

        async def carry() -> None:
            try:
                result = await work
            except asyncio.CancelledError:
                if not out.done():
                    out.cancel()
                raise
            except BaseException as exc:  # (the caller's, unless it was answered 504)
                if not out.done():
                    out.set_exception(exc)
                return
            if not out.done():
                out.set_result(result)

        running = eager_future(loop, carry())
        if out.done():
            return out.result()

        def overdue() -> None:
            if out.done():
                return
            if background:
                self._inflight += 1  # (drain waits for it as for a request)
                running.add_done_callback(self._background_done)
            out.set_exception(DeadlineExceeded(late()))

        timer = loop.call_at(deadline, overdue)
        try:
            return await out
        except asyncio.CancelledError:
            if not running.done() and not (out.done() and not out.cancelled()):
                # the caller left: its work stops, as it did before (a keyed run's
                # wrapper stops waiting; the cached run goes on for a retry: _answers)
                running.cancel()
            raise
        finally:
            timer.cancel()

    def _background_done(self, running: asyncio.Future[Any]) -> None:
        retrieved(running)  # (its outcome went to the flow already)
        self._left()

    def _left(self) -> None:
        """One request (or a keyed run that outlives its caller) is done: drain may end."""
        self._inflight -= 1
        if not self._inflight and self._drained is not None:
            self._drained.set()

    async def drain(self, timeout_s: float) -> bool:
        """Take no new request; wait up to ``timeout_s`` for those in flight (True: none left)."""
        self._closing = True
        if not self._inflight:
            return True
        if self._drained is None:  # one event for every caller (stop may come twice)
            self._drained = asyncio.Event()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _infer(
        self,
        model: str,
        request: InferRequest,
        deadline_ms: float | None,
        priority: int | None,
        deferrable: bool,
        principal: str,
    ) -> InferResponse:
        start = time.monotonic()
        self._known(model)
        # The app's id is echoed back but never used inside: apps reuse ids
        # ("1"), and the MQTT correlation, the deferred store and the cloud's
        # idempotency cache all need one unique per request.
        client_id, request.id = request.id, os.urandom(16).hex()  # a fresh id (uuid4's bits)
        try:
            # The id is also the cloud's idempotency key on every offload (HTTP and MQTT):
            # a resend of this request is answered once, never run twice.  An app's own
            # key goes instead (checked as the cloud checks it), so the app's retry is
            # answered from the cloud's cache too, and a deferral is named after it.
            app_key = idempotency_key(request.parameters)
            if app_key is not None and principal:
                # the cloud knows only the agent's own token: two apps' equal keys were
                # one key there (one app got the other's answer, or its 409)
                app_key = scoped_key(principal, app_key)
            request.parameters = {**request.parameters, "idempotency_key": app_key or request.id}
            if priority is not None:
                request.parameters = {**request.parameters, "priority": priority}
            # A version the cloud serves (not the local variant's) runs there only and goes
            # with the request; the local one's number means nothing to the cloud.
            cloud_version = self._cloud_version(model, request.model_version)
            if not cloud_version:
                request.model_version = None

            async def run() -> InferResponse:
                # (a keyed run goes on when its caller leaves, to answer the retry:
                # drain waits for it as for a request; its caller's deadline is kept
                # outside it, so a retry after that 504 joins the run still going)
                self._inflight += 1
                try:
                    return await answer(bounded=False)
                finally:
                    self._left()

            async def answer(bounded: bool = True) -> InferResponse:
                flow = self._begin(
                    model,
                    request,
                    start,
                    deadline_ms=deadline_ms,
                    deferrable=deferrable,
                    cloud_only=cloud_version,
                    versioned=cloud_version,
                )
                drive = self._drive(flow, request, start, principal, client_id)
                if flow.deferrable or not bounded:
                    return await drive  # (a deferral's deadline bounds its receipt: _drive)
                return await self._by_deadline(
                    drive, flow.deadline, lambda: _no_answer(flow.model, flow.budget_ms, flow)
                )

            duplicate = False
            if app_key is None:
                response = await answer()
            else:
                # the app's retry is answered once wherever it runs, and its key reused
                # with other inputs is a 409 here as at the cloud; a deferral's receipt
                # is not kept (the store knows the deferral by the key: a retry after it
                # failed or expired is stored afresh)
                # (a retry joining a run still going waits within its own deadline)
                mp = self.core.policy.model_policy(model)
                budget = (
                    deadline_ms or mp.deadline_ms or self.core.policy.config.default_deadline_ms
                )
                keyed = self._answers.run(
                    (model, request.model_version, app_key),
                    run,
                    fingerprint(request, 0),
                    keep=lambda answered: answered.parameters.get("where") != "deferred",
                    deadline=None if deferrable else start + budget / 1000.0,
                )
                if deferrable:
                    response, duplicate = await keyed
                else:
                    response, duplicate = await self._by_deadline(
                        keyed,
                        start + budget / 1000.0,
                        lambda: _no_answer(model, budget, None),
                        background=False,
                    )
                if duplicate:
                    response = as_duplicate(response)
        except FerryError as exc:
            self.stats.failure(model, time.monotonic() - start, exc.code.value)
            raise
        # (a shared answer ran nothing: counted apart, no queue or compute time again)
        shown = {"where": "duplicate"} if duplicate else response.parameters
        self.stats.success(model, shown, time.monotonic() - start, self._items(model, request))
        response.id = client_id
        return response

    async def _drive(
        self,
        flow: RequestFlow,
        request: InferRequest,
        start: float,
        principal: str = "",
        app_id: str | None = None,
    ) -> InferResponse:
        """Carry out the flow's actions until it answers."""
        if not flow.deferrable and time.monotonic() >= flow.deadline:
            # Nothing starts past its deadline (a local run queued past it is not run):
            # the fastest option sent anyway came back a late 200 where a local run got
            # a 504.  Checked before the flow takes a breaker trial or a data reservation.
            raise DeadlineExceeded(
                f"the request's deadline passed before it could start (model {flow.model!r})"
            )
        action = flow.start()
        local_answer: InferResponse | None = None
        cloud: InferResponse | None = None
        while True:
            if isinstance(action, RunLocal):
                local_answer, seconds, raw = await self._local(flow, request)
                confidence = None
                if flow.wants_confidence:
                    # (from the raw scores: a classification answer is top-k strings)
                    config = self.local.get(flow.mp.local_model or "").config
                    confidence = _cascade_confidence(raw, cascade_output(flow.mp, config))
                action = flow.local_done(time.monotonic(), seconds, confidence)
            elif isinstance(action, Hedge):
                action, local_answer, cloud = await self._hedge(flow, request, action)
            elif isinstance(action, Offload):
                transport = self.transports[action.option.transport or ""]
                try:
                    result = await self._offloaded(
                        action.option.transport or "",
                        transport.infer(action.cloud_model, request, action.give_up_at),
                    )
                except FerryError as exc:
                    if not isinstance(exc, InvalidInput):
                        log.info("offload failed: %s", exc)
                    action = flow.offload_failed(time.monotonic(), exc)
                    self._say_breakers()
                    continue
                cloud = result.response
                action = _reply_event(flow, result)
            elif isinstance(action, Answer):
                response = cloud if action.where != LOCAL else local_answer
                assert response is not None
                response.model_name = flow.model
                response.parameters = {
                    **(response.parameters if response is cloud else {}),
                    **provenance(
                        action.where,
                        action.option,
                        time.monotonic() - start,
                        action.energy_j,
                        action.sent,
                        action.received,
                        action.reason,
                        action.fallback,
                        **action.extra,
                    ),
                }
                return response
            elif isinstance(action, Defer):
                if self.deferrer is None:
                    raise ModelNotReady(action.reason)
                key = request.parameters.get("idempotency_key")
                if key is not None and key != request.id:
                    # an app's key: its retry finds this deferral, not a second one
                    request.id = receipt_id(flow.model, key, request)
                return await self.deferrer.defer(
                    flow.model,
                    request,
                    deadline_ms=action.deadline_ms,
                    reason=action.reason,
                    owner=principal,
                    app_id=app_id,
                )
            else:
                assert isinstance(action, Fail)
                raise self._explained(action.error, flow.mp.cloud_model)

    async def _hedge(
        self, flow: RequestFlow, request: InferRequest, hedge: Hedge
    ) -> tuple[Action, InferResponse | None, InferResponse | None]:
        """Run locally and offload at once; the first answer goes back, the other teaches.

        A race (``hedge.local_at``) starts the local run only when it is due,
        or when the offload fails before then, unless the cloud answered first.
        Returns the flow's answer with the local and cloud responses so far;
        the half still running is awaited in the background (it ends by the
        offload's give-up time) and its outcome fed to the flow.
        """
        offload = hedge.offload
        transport = self.transports[offload.option.transport or ""]
        cloud_t = asyncio.create_task(
            self._offloaded(
                offload.option.transport or "",
                transport.infer(offload.cloud_model, request, offload.give_up_at),
            )
        )
        local_t: asyncio.Task[Any] | None = None
        cancel = Cancel()  # stops the local run when the cloud answers first (flow's call)
        due = hedge.local_at  # a race's local run, not started yet
        if due is None:
            local_t = asyncio.create_task(self._run_local(flow, request, cancel))
        local_answer: InferResponse | None = None
        cloud: InferResponse | None = None
        local_error: BaseException | None = None
        pending: set[asyncio.Task[Any]] = {cloud_t} if local_t is None else {local_t, cloud_t}

        def hand_over(tasks: set[asyncio.Task[Any]]) -> None:
            # What still runs (or ended in the same tick) is learnt from when it ends;
            # an offload nobody waits on is sent no hedges (they cost the cloud a run)
            if cloud_t in tasks and request.id and hasattr(transport, "stop_hedging"):
                transport.stop_hedging(request.id)
            for rest in tasks:
                rest.add_done_callback(lambda t: self._late(flow, t, local_t))
                self._background.add(rest)
                rest.add_done_callback(self._background.discard)

        while pending:
            timeout = None if due is None else max(due - time.monotonic(), 0.0)
            try:
                done, pending = await asyncio.wait(
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                hand_over(pending)  # the caller left; the halves still teach
                raise
            if not done:  # the race's local run is due
                due = None
                if flow.race_due(time.monotonic()) is not None:
                    local_t = asyncio.create_task(self._run_local(flow, request, cancel))
                    pending.add(local_t)
                continue
            ordered = sorted(done, key=lambda t: t is not local_t)  # local first on a tie
            for k, task in enumerate(ordered):
                action: Action | None = None
                if task is local_t:
                    local_error = task.exception()
                    if local_error is None:
                        local_answer, seconds = task.result()
                        action = flow.local_done(time.monotonic(), seconds)
                else:
                    action, cloud = self._hedged_reply(flow, task)
                    if isinstance(action, RunLocal):  # a race's cloud failed first
                        due, action = None, None
                        local_t = asyncio.create_task(self._run_local(flow, request, cancel))
                        pending.add(local_t)
                if action is not None:
                    if isinstance(action, Answer) and action.cancel_local:
                        cancel.cancel()  # its end (RunCancelled) teaches nothing
                    hand_over(pending | set(ordered[k + 1 :]))
                    return action, local_answer, cloud
        # Neither half answered: the cloud failed and so did the local run.
        assert local_error is not None
        raise local_error

    def _hedged_reply(
        self, flow: RequestFlow, task: asyncio.Task[Any]
    ) -> tuple[Action | None, InferResponse | None]:
        exc = task.exception()
        if isinstance(exc, FerryError):
            return flow.offload_failed(time.monotonic(), exc), None
        if exc is not None:
            raise exc
        result = task.result()
        return _reply_event(flow, result), result.response

    def _late(self, flow: RequestFlow, task: asyncio.Task[Any], local_t: asyncio.Task[Any]) -> None:
        """The half of a hedge that ended after the answer: learn from it, answer nothing."""
        if task.cancelled():
            return  # the agent is stopping
        try:
            if task is local_t:
                if task.exception() is None:
                    flow.local_done(time.monotonic(), task.result()[1])
            else:
                self._hedged_reply(flow, task)
        except Exception:  # learning must never break the loop
            log.exception("learning from a hedge's late half failed")

    async def _run_local(
        self, flow: RequestFlow, request: InferRequest, cancel: Cancel | None = None
    ) -> tuple[InferResponse, float]:
        answer, seconds, _ = await self._local(flow, request, cancel)
        return answer, seconds

    async def _local(
        self, flow: RequestFlow, request: InferRequest, cancel: Cancel | None = None
    ) -> tuple[InferResponse, float, dict[str, np.ndarray]]:
        """The local answer, its compute seconds and the runtime's raw outputs."""
        name = flow.mp.local_model
        assert name is not None
        local = self.local.get(name)
        config = local.config
        # The cloud's checks and Triton's classification extension, on the local
        # variant's own config: the same request gets the same answer or error here.
        # (named as the app asked: "model 'types' has no input" puzzled one that sent 'typesl')
        asked = config if config.name == flow.model else replace(config, name=flow.model)
        inputs = validated_inputs(asked, request)
        wanted = validated_outputs(asked, request)
        classes = requested_classes(config, request)
        run = wanted
        if flow.wants_confidence and wanted is not None:
            # the scores are read whatever the app asked for (dropped from its answer):
            # where a request runs never changes whether it is refused
            scores = cascade_output(flow.mp, config)
            run = wanted if scores in wanted else [*wanted, scores]
        outputs, seconds = await self.local.run(name, inputs, run, cancel, flow.deadline)
        tensors = []
        for n in wanted or list(outputs):
            if classes and n in classes:
                labels = getattr(local.session, "labels", {}).get(n)
                strings = top_k(outputs[n], classes[n], bool(config.max_batch_size), labels)
                tensors.append(Tensor(n, "BYTES", strings))
            else:
                tensors.append(output_tensor(n, outputs[n], config))
        return (
            InferResponse(
                model_name=flow.model,
                model_version=str(local.version),
                id=request.id,
                outputs=tensors,
            ),
            seconds,
            outputs,
        )

    async def close(self) -> None:
        """Stop learning from hedges still running (before transports and runtimes close)."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()

    async def send_deferred(self, model: str, request: InferRequest) -> InferResponse:
        """Offload a stored request now (the store-and-forward flusher's sender).

        The request id travels as the cloud's idempotency key: a request
        resent after a crash between the cloud's answer and the store's
        bookkeeping is answered from the cloud's cache, not run twice.
        Nobody waits on it: the cloud gets three times what the link is
        expected to take, and at least ``DEFERRED_SEND_S``.
        """
        assert request.id is not None
        if "idempotency_key" not in request.parameters:  # (an app's key was kept)
            request.parameters = {**request.parameters, "idempotency_key": request.id}
        start = time.monotonic()
        flow = self._begin(
            model,
            request,
            start,
            deadline_ms=DEFERRED_SEND_S * 1000,
            mode="deferred",
            cloud_only=True,
        )
        return await self._drive(flow, request, start)

    async def _offloaded(self, name: str, sent: Awaitable[TransferResult]) -> TransferResult:
        """An offload's outcome, noted for the log (see _say_breakers)."""
        try:
            result = await sent
        except FerryError as exc:
            self._last_failure[name] = exc.message
            raise
        if self._breaker_said.get(name, "ok") != "ok":  # (said unusable: back now)
            self._say_breakers(worked=name)
        return result

    def _say_breakers(self, worked: str | None = None) -> None:
        """A transport that became unusable (its endpoint down, or its breaker open after
        repeated failures: one state, or a refused endpoint's rechecks flip between the
        two every few seconds), and its return (``worked``: it just answered), are said
        once each: during a cloud outage the agent had logged nothing while every
        request fell back to local."""
        for name, transport in self.transports.items():
            breaker = self.core.breakers.get(name)
            said = self._breaker_said.get(name, "ok")
            if not transport.connected:
                why = "not reachable"
            elif breaker is not None and breaker.state == "open":
                why = "offloads paused after repeated failures"
            elif name == worked and said != "ok":
                self._breaker_said[name] = "ok"
                log.info("cloud over %s: usable again", name)
                continue
            else:
                continue  # (usable, or seems so again: said once it answers)
            if said == "ok":
                self._breaker_said[name] = "unusable"
                last = self._last_failure.get(name)
                log.warning(
                    "cloud over %s: %s%s; requests run locally or wait until it answers again",
                    name,
                    why,
                    f" (last: {last})" if last else "",
                )

    async def probe(self) -> None:
        """Carry out the core's probes (open breakers' trials, stale RTTs on a warm radio)."""
        self._say_breakers()
        for name in self.core.probes(time.monotonic()):
            probe = getattr(self.transports[name], "probe", None)
            if probe is None:
                continue
            try:
                rtt = await probe(deadline=time.monotonic() + 2.0)
            except FerryError as exc:
                self._last_failure[name] = exc.message
                self.core.probe_failed(name, time.monotonic())
                continue
            self.core.probe_done(name, time.monotonic(), rtt)
            self._say_breakers(worked=name)
        self._say_breakers()


def _reply_event(flow: RequestFlow, result: TransferResult) -> Action | None:
    """Tell the flow the cloud answered (timing, bytes, the cloud's own queue and compute)."""
    params = result.response.parameters
    return flow.offload_done(
        time.monotonic(),
        sent=result.sent_bytes,
        received=result.received_bytes,
        elapsed_s=result.elapsed_s,
        queue_us=int(params.get("queue_us", 0) or 0),
        compute_us=int(params.get("compute_us", 0) or 0),
        resent=result.resent,
    )


def cascade_output(mp: ModelPolicy, config: ModelConfig) -> str:
    """The output a cascade reads its confidence from: the policy's, or the local
    model's first declared output (not the first the app asked for: which outputs a
    request names must not move it between tiers)."""
    return mp.cascade_output or config.outputs[0].name


def _cascade_confidence(raw: dict[str, np.ndarray], name: str) -> float:
    """The least top-1 confidence over the batch's rows of the scores output (an
    empty batch has no row to doubt: it is answered where it ran)."""
    scores = np.asarray(raw[name])
    if scores.dtype.kind not in "iuf":  # (the load refuses such a config; a safeguard)
        raise InvalidInput(
            f"output {name!r} ({scores.dtype}, shape {list(scores.shape)}) holds no scores "
            "to read a confidence from; set cascade_output to the model's score output"
        )
    if scores.size == 0:
        return 1.0
    rows = scores.reshape(scores.shape[0] if scores.ndim > 1 else 1, -1)
    return min(confidence(row) for row in rows)


__all__ = ["DeadlineExceeded", "EdgeDataPlane", "ModelPolicy"]


def _toml_key(name: str) -> str:
    """``name`` as one TOML key (quoted unless bare: ``a.b`` bare is two tables)."""
    if name and all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        return name
    return json.dumps(name)


def _no_answer(model: str, budget_ms: float, flow: RequestFlow | None) -> str:
    why = f"; {flow.decision.reason}" if flow is not None and flow.decision else ""
    return f"model {model!r}: no answer within the request's deadline ({budget_ms:g} ms{why})"
