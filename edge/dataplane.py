"""The edge agent's one dataplane: decide, run or offload, fall back, learn.

Both fronts (the local V2 HTTP API and the asyncio Python API) call
:meth:`EdgeDataPlane.infer`.  Every request gets exactly one answer: a
result (local or cloud), a deferred receipt (stored durably, answered
later), or a typed error.  Each answer carries its provenance in
``parameters``: where it ran, predicted vs actual latency, estimated energy
and bytes moved, and whether a fallback happened.

A request reads the model's policy once, on arrival, so a configuration
reloaded while it is in flight cannot change its mapping half-way.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np

from edge.core.accounting import Usage, batch_rows, provenance, request_bytes
from edge.core.breaker import CircuitBreaker
from edge.core.energy import RadioState, local_energy_j
from edge.core.estimators import Estimators
from edge.core.policy import LOCAL, Context, Decision, ModelPolicy, Option, Policy, fallback_plan
from edge.core.scores import confidence
from edge.local import LocalModels
from edge.stats import AgentStats
from edge.transports.base import TransferResult, Transport
from shared.errors import (
    DeadlineExceeded,
    FerryError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
)
from shared.messages import InferRequest, InferResponse
from shared.tensors import Tensor

log = logging.getLogger(__name__)

# Errors that say the endpoint (not this request) is in trouble: only these
# count towards a transport's circuit breaker.  A 404 or a bad input says
# nothing about whether the next request to another model will succeed.
ENDPOINT_FAILURES = (ModelNotReady, DeadlineExceeded, Overloaded)
# How long a cloud that answered "no such model" is not asked for it again.
MISSING_MODEL_COOLDOWN_S = 30.0
# The least time a stored (deferred) request is given to cross the link.
DEFERRED_SEND_S = 30.0
# A link estimate older than this is refreshed by a probe (when the radio is up).
STALE_PROBE_S = 30.0


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
    ) -> None:
        self.policy = policy
        self.est = estimators
        self.local = local
        self.transports = transports
        self.breakers = breakers or {name: CircuitBreaker() for name in transports}
        self.deferrer = deferrer
        self.battery = battery  # callable -> percent | None
        self.radio = RadioState()
        self.usage = Usage(estimators.extra.setdefault("usage", {}))
        self.stats = AgentStats()
        self._out_bytes: dict[str, int] = {}
        self._missing: dict[tuple[str, str], float] = {}  # (transport, cloud model) -> until

    # ---- the decision ---------------------------------------------------------
    def usable(self, now: float, cloud_model: str | None = None) -> dict[str, bool]:
        """Transports a request for ``cloud_model`` may take now."""
        out = {}
        for name, transport in self.transports.items():
            ok = transport.connected and self.breakers[name].state == "closed"
            if ok and cloud_model is not None:
                ok = self._missing.get((name, cloud_model), 0.0) <= now
                serves = getattr(transport, "serves", None)
                ok = ok and (serves is None or serves(cloud_model) is not False)
            out[name] = ok
        return out

    def context(
        self, mp: ModelPolicy, model: str, request: InferRequest, deadline_s: float, now: float
    ) -> Context:
        return Context(
            now=now,
            deadline_s=deadline_s,
            in_bytes=request_bytes(request),
            connected=self.usable(now, mp.cloud_model),
            battery_percent=self.battery() if self.battery else None,
            data_used_mb_today=self.usage.today(),
            radio_idle_s=self.radio.radio_idle_s(now),
            out_bytes=self._out_bytes.get(model),
            batch=batch_rows(request),
            local_backlog=self.local.backlog(mp.local_model) if mp.local_model else 0,
        )

    def decide(
        self,
        model: str,
        request: InferRequest,
        deadline_s: float,
        mode: str | None = None,
        mp: ModelPolicy | None = None,
    ) -> Decision:
        mp = mp or self.policy.model_policy(model)
        now = time.monotonic()
        return self.policy.decide(model, self.context(mp, model, request, deadline_s, now), mode)

    # ---- serving --------------------------------------------------------------
    async def infer(
        self,
        model: str,
        request: InferRequest,
        *,
        deadline_ms: float | None = None,
        priority: int | None = None,
        deferrable: bool = False,
    ) -> InferResponse:
        start = time.monotonic()
        # The app's id is echoed back but never used inside: apps reuse ids
        # ("1"), and the MQTT correlation, the deferred store and the cloud's
        # idempotency cache all need one unique per request.
        client_id, request.id = request.id, uuid.uuid4().hex
        try:
            response = await self._infer(model, request, start, deadline_ms, priority, deferrable)
        except FerryError as exc:
            self.stats.failure(model, time.monotonic() - start, exc.code.value)
            raise
        params = response.parameters
        self.stats.success(model, params, time.monotonic() - start)
        response.id = client_id
        return response

    async def _infer(
        self,
        model: str,
        request: InferRequest,
        start: float,
        deadline_ms: float | None,
        priority: int | None,
        deferrable: bool,
    ) -> InferResponse:
        policy = self.policy  # one snapshot for the whole request
        mp = policy.model_policy(model)
        if mp.local_model is not None and not self.local.has(mp.local_model):
            mp = ModelPolicy(**{**mp.__dict__, "local_model": None})
        if mp.local_model is None and mp.cloud_model is None:
            raise ModelNotFound(f"unknown model {model!r}")
        if mp.local_model is None and mp.mode == "local":
            raise ModelNotReady(f"model {model!r} is local-only and its local variant is missing")
        budget_ms = deadline_ms or mp.deadline_ms or policy.config.default_deadline_ms
        if budget_ms <= 0:
            raise InvalidInput(f"deadline_ms must be positive, got {budget_ms}")
        deadline = start + budget_ms / 1000.0
        if priority is not None:
            request.parameters = {**request.parameters, "priority": priority}

        mode = mp.mode if mp.local_model is not None else "cloud"
        if mode == "cascade":
            return await self._cascade(model, mp, request, deadline, start)
        decision = policy.decide(
            model, self.context(mp, model, request, deadline - start, start), mode
        )
        choice = decision.choice
        if choice is None:
            if deferrable and self.deferrer is not None:
                return await self.deferrer.defer(
                    model, request, deadline_ms=budget_ms, reason=decision.reason
                )
            raise ModelNotReady(
                f"model {model!r} cannot run now: {decision.reason} "
                f"({', '.join(f'{o.name}: {o.reason}' for o in decision.options) or 'no options'})"
            )
        if choice.name == LOCAL:
            return await self._run_local(model, mp, request, choice, start, decision.reason)
        local = next((o for o in decision.options if o.name == LOCAL), None)
        if local is None and mode == "cloud":
            # Cloud by choice, but a local variant still beats an error when the cloud fails.
            local = policy.local_option(mp)
        return await self._offload(
            model, mp, request, choice, local, deadline, start, deferrable, decision.reason
        )

    async def _run_local(
        self,
        model: str,
        mp: ModelPolicy,
        request: InferRequest,
        option: Option | None,
        start: float,
        reason: str,
        fallback: bool = False,
        attempt: Option | None = None,
    ) -> InferResponse:
        assert mp.local_model is not None
        local = self.local.get(mp.local_model)
        outputs, seconds = await self.local.run(
            mp.local_model, request.input_dict(), request.output_names()
        )
        now = time.monotonic()
        self.est.local(mp.local_model, batch_rows(request)).add(seconds, now)
        names = request.output_names() or list(outputs)
        specs = {t.name: t.datatype for t in local.config.outputs}
        tensors = [
            Tensor(n, specs[n], outputs[n]) if n in specs else Tensor.from_array(n, outputs[n])
            for n in names
        ]
        energy = local_energy_j(self.policy.device, seconds)
        extra: dict[str, Any] = {"compute_us": int(seconds * 1e6)}
        if attempt is not None:
            # The failed offload kept the radio on and sent bytes a metered link bills.
            energy += attempt.energy_j
            extra["bytes_attempted"] = attempt.up_bytes
        return InferResponse(
            model_name=model,
            model_version=str(local.version),
            id=request.id,
            outputs=tensors,
            parameters=provenance(
                LOCAL, option, now - start, energy, 0, 0, reason, fallback, **extra
            ),
        )

    async def _offload(
        self,
        model: str,
        mp: ModelPolicy,
        request: InferRequest,
        choice: Option,
        local: Option | None,
        deadline: float,
        start: float,
        deferrable: bool,
        reason: str,
    ) -> InferResponse:
        assert choice.transport is not None and mp.cloud_model is not None
        transport = self.transports[choice.transport]
        cloud_deadline, local = fallback_plan(time.monotonic(), deadline, local, choice)
        if mp.local_model is None:
            local = None
        try:
            result = await transport.infer(mp.cloud_model, request, cloud_deadline)
        except InvalidInput:
            raise
        except FerryError as exc:
            now = time.monotonic()
            self._learn_failure(choice, mp.cloud_model, exc, start, now)
            why = f"{choice.name} failed ({exc.code.value}: {exc.message})"
            if local is not None and deadline - now > 0:
                log.info("falling back to local: %s", why)
                return await self._run_local(model, mp, request, local, start, why, True, choice)
            if deferrable and self.deferrer is not None:
                return await self.deferrer.defer(model, request, deadline_ms=None, reason=why)
            raise
        return self._learn(model, mp, choice, result, start, reason)

    def _learn_failure(
        self, choice: Option, cloud_model: str, exc: FerryError, start: float, now: float
    ) -> None:
        assert choice.transport is not None
        transport = choice.transport
        # Bytes that left the device count against the daily cap even without an answer.
        self.usage.add(choice.up_bytes)
        if isinstance(exc, ModelNotFound):
            self._missing[(transport, cloud_model)] = now + MISSING_MODEL_COOLDOWN_S
            return
        if not isinstance(exc, ENDPOINT_FAILURES):
            return  # this request's own failure; the endpoint is fine
        self.breakers[transport].record_failure(now)
        if isinstance(exc, DeadlineExceeded):
            self.est.link(transport).observe_timeout(choice.up_bytes, now - start, now)
        else:
            self.est.link(transport).observe_failure(now)

    def _learn(
        self,
        model: str,
        mp: ModelPolicy,
        choice: Option,
        result: TransferResult,
        start: float,
        reason: str,
    ) -> InferResponse:
        now = time.monotonic()
        assert choice.transport is not None
        self.breakers[choice.transport].record_success(now)
        params = result.response.parameters
        queue_us = int(params.get("queue_us", 0) or 0)
        compute_us = int(params.get("compute_us", 0) or 0)
        self.est.observe_reply(mp.cloud_model or model, queue_us, compute_us, now)
        # The radio's promotion is in the transfer's time and the policy adds it
        # itself; a transfer quicker than the promotion found the radio up already.
        elapsed = result.elapsed_s
        if elapsed > choice.promotion_s:
            elapsed -= choice.promotion_s
        self.est.link(choice.transport).observe(
            result.sent_bytes,
            result.received_bytes,
            elapsed,
            (queue_us + compute_us) / 1e6,
            now,
        )
        self.radio.transfer_done(now)
        self.usage.add(result.sent_bytes + result.received_bytes)
        self._out_bytes[model] = result.received_bytes
        response = result.response
        response.model_name = model
        response.parameters = {
            **params,
            **provenance(
                choice.name,
                choice,
                now - start,
                choice.energy_j,
                result.sent_bytes,
                result.received_bytes,
                reason,
                False,
            ),
        }
        return response

    async def _cascade(
        self, model: str, mp: ModelPolicy, request: InferRequest, deadline: float, start: float
    ) -> InferResponse:
        wanted = request.output_names()
        if wanted is not None and mp.cascade_output and mp.cascade_output not in wanted:
            raise InvalidInput(
                f"model {model!r} cascades on output {mp.cascade_output!r}: request it too, "
                "or leave the outputs unset"
            )
        local_opt = self.policy.local_option(mp)
        local_answer = await self._run_local(
            model, mp, request, local_opt, start, "cascade: local first"
        )
        conf = _cascade_confidence(local_answer, mp.cascade_output)
        local_answer.parameters["confidence"] = round(conf, 4)
        if conf >= mp.cascade_threshold:
            return local_answer
        now = time.monotonic()
        decision = self.decide(model, request, deadline - now, mode="cloud", mp=mp)
        if decision.choice is None:
            local_answer.parameters["cascade"] = (
                f"unsure ({conf:.2f}) but no cloud: {decision.reason}"
            )
            return local_answer
        cloud_only = ModelPolicy(**{**mp.__dict__, "local_model": None})
        try:
            answer = await self._offload(
                model,
                cloud_only,
                request,
                decision.choice,
                None,
                deadline,
                start,
                False,
                f"cascade: local confidence {conf:.2f} < {mp.cascade_threshold}",
            )
        except FerryError as exc:
            local_answer.parameters["cascade"] = f"offload failed: {exc.message}"
            return local_answer
        answer.parameters["confidence"] = round(conf, 4)
        answer.parameters["energy_j"] = round(
            answer.parameters.get("energy_j", 0.0) + local_answer.parameters.get("energy_j", 0.0), 6
        )
        return answer

    async def send_deferred(self, model: str, request: InferRequest) -> InferResponse:
        """Offload a stored request now (the store-and-forward flusher's sender).

        The request id travels as the cloud's idempotency key: a request
        resent after a crash between the cloud's answer and the store's
        bookkeeping is answered from the cloud's cache, not run twice.
        """
        mp = self.policy.model_policy(model)
        if mp.cloud_model is None:
            raise ModelNotFound(f"model {model!r} has no cloud variant to send deferred work to")
        assert request.id is not None
        request.parameters = {**request.parameters, "idempotency_key": request.id}
        cloud_only = ModelPolicy(**{**mp.__dict__, "local_model": None})
        decision = self.decide(model, request, DEFERRED_SEND_S, mode="cloud", mp=cloud_only)
        if decision.choice is None:
            raise ModelNotReady(decision.reason)
        start = time.monotonic()
        # Nobody waits on it: give it three times what the link is expected to take.
        budget = max(DEFERRED_SEND_S, 3 * decision.choice.latency_q_s)
        return await self._offload(
            model,
            cloud_only,
            request,
            decision.choice,
            None,
            start + budget,
            start,
            False,
            "deferred",
        )

    async def probe(self) -> None:
        """Give open breakers their trial, and refresh stale RTTs while the radio is up.

        A stale estimate is refreshed only while the radio is still in its
        tail from real traffic: on a cellular link a probe from idle costs a
        promotion and a whole tail (~12 J on LTE) to learn an RTT, and a
        request that can afford it explores the link anyway.
        """
        now = time.monotonic()
        stale = set(self.est.stale_links(now, STALE_PROBE_S))
        idle = self.radio.radio_idle_s(now)
        for name, transport in self.transports.items():
            breaker = self.breakers[name]
            if breaker.state == "closed":
                link = self.policy.links.get(name)
                warm = idle is not None and link is not None and idle < link.tail_s
                if name not in stale or not warm:
                    continue
            elif not breaker.allow(now):
                continue
            probe = getattr(transport, "probe", None)
            if probe is None:
                continue
            try:
                rtt = await probe(deadline=time.monotonic() + 2.0)
            except FerryError:
                breaker.record_failure(time.monotonic())
                continue
            t = time.monotonic()
            breaker.record_success(t)
            self.radio.transfer_done(t)
            self.est.link(name).observe_probe(rtt, t)


def _cascade_confidence(answer: InferResponse, output: str | None) -> float:
    """The least top-1 confidence over the batch's rows of the scores output."""
    tensor = answer.output(output) if output else answer.outputs[0]
    scores = tensor.data
    if tensor.datatype in ("BYTES", "BOOL") or scores.size == 0:
        raise InvalidInput(
            f"output {tensor.name!r} ({tensor.datatype}, shape {list(scores.shape)}) holds no "
            "scores to read a confidence from; set cascade_output to the model's score output"
        )
    rows = np.asarray(scores).reshape(scores.shape[0] if scores.ndim > 1 else 1, -1)
    return min(confidence(row) for row in rows)


__all__ = ["DeadlineExceeded", "EdgeDataPlane"]
