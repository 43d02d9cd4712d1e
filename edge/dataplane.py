"""The edge agent's one dataplane: decide, run or offload, fall back, learn.

Both fronts (the local V2 HTTP API and the asyncio Python API) call
:meth:`EdgeDataPlane.infer`.  Every request gets exactly one answer: a
result (local or cloud), a deferred receipt (stored durably, answered
later), or a typed error.  Each answer carries its provenance in
``parameters``: where it ran, predicted vs actual latency, estimated energy
and bytes moved, and whether a fallback happened.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge.breaker import CircuitBreaker
from edge.energy import RadioState
from edge.estimators import Estimators
from edge.local import LocalModels
from edge.policy import LOCAL, Context, Decision, Option, Policy, fallback_plan
from edge.scores import confidence
from edge.transports.base import TransferResult, Transport
from shared.errors import (
    DeadlineExceeded,
    FerryError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
)
from shared.messages import InferRequest, InferResponse
from shared.tensors import Tensor

log = logging.getLogger(__name__)


@dataclass
class Usage:
    """Bytes moved today (for the data cap), reset at the first request of a new day."""

    day: int = 0
    mb: float = 0.0

    def add(self, nbytes: int) -> None:
        today = int(time.time() // 86400)
        if today != self.day:
            self.day, self.mb = today, 0.0
        self.mb += nbytes / 1e6

    def today(self) -> float:
        return self.mb if int(time.time() // 86400) == self.day else 0.0


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
        self.usage = Usage()
        self._out_bytes: dict[str, int] = {}

    # ---- the decision ---------------------------------------------------------
    def usable(self, now: float) -> dict[str, bool]:
        out = {}
        for name, transport in self.transports.items():
            breaker = self.breakers[name]
            out[name] = transport.connected and breaker.state == "closed"
        return out

    def context(self, model: str, request: InferRequest, deadline_s: float, now: float) -> Context:
        in_bytes = sum(t.data.nbytes if t.datatype != "BYTES" else 64 for t in request.inputs) + 256
        return Context(
            now=now,
            deadline_s=deadline_s,
            in_bytes=in_bytes,
            connected=self.usable(now),
            battery_percent=self.battery() if self.battery else None,
            data_used_mb_today=self.usage.today(),
            radio_idle_s=self.radio.radio_idle_s(now),
            out_bytes=self._out_bytes.get(model),
        )

    def decide(
        self, model: str, request: InferRequest, deadline_s: float, mode: str | None = None
    ) -> Decision:
        now = time.monotonic()
        return self.policy.decide(model, self.context(model, request, deadline_s, now), mode)

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
        mp = self.policy.model_policy(model)
        if (
            mp.local_model is not None
            and not self.local.has(mp.local_model)
            and mp.cloud_model is None
        ):
            raise ModelNotFound(f"unknown model {model!r}")
        if mp.local_model is not None and not self.local.has(mp.local_model):
            mp_local = None
        else:
            mp_local = mp.local_model
        if mp_local is None and mp.cloud_model is None:
            raise ModelNotFound(f"unknown model {model!r}")
        budget_ms = deadline_ms or mp.deadline_ms or self.policy.config.default_deadline_ms
        if budget_ms <= 0:
            raise InvalidInput(f"deadline_ms must be positive, got {budget_ms}")
        deadline = start + budget_ms / 1000.0
        request.id = request.id or uuid.uuid4().hex
        if priority is not None:
            request.parameters = {**request.parameters, "priority": priority}

        mode = mp.mode if mp_local is not None else "cloud"
        if mode == "cascade":
            return await self._cascade(model, request, deadline, start, deferrable)
        decision = self.decide(model, request, deadline - start, mode)
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
            return await self._run_local(model, request, choice, start, decision.reason)
        local = next((o for o in decision.options if o.name == LOCAL), None)
        return await self._offload(
            model, request, choice, local, deadline, start, deferrable, decision.reason
        )

    async def _run_local(
        self,
        model: str,
        request: InferRequest,
        option: Option | None,
        start: float,
        reason: str,
        fallback: bool = False,
    ) -> InferResponse:
        mp = self.policy.model_policy(model)
        assert mp.local_model is not None
        local = self.local.get(mp.local_model)
        outputs, seconds = await self.local.run(
            mp.local_model, request.input_dict(), request.output_names()
        )
        now = time.monotonic()
        self.est.local(mp.local_model).add(seconds, now)
        names = request.output_names() or list(outputs)
        specs = {t.name: t.datatype for t in local.config.outputs}
        tensors = [
            Tensor(n, specs[n], outputs[n]) if n in specs else Tensor.from_array(n, outputs[n])
            for n in names
        ]
        energy = option.energy_j if option and option.energy_j else self._local_energy(seconds)
        return InferResponse(
            model_name=model,
            model_version=str(local.version),
            id=request.id,
            outputs=tensors,
            parameters=_provenance(
                LOCAL,
                option,
                now - start,
                energy,
                0,
                0,
                reason,
                fallback,
                compute_us=int(seconds * 1e6),
            ),
        )

    def _local_energy(self, seconds: float) -> float:
        from edge.energy import local_energy_j

        return local_energy_j(self.policy.device, seconds)

    async def _offload(
        self,
        model: str,
        request: InferRequest,
        choice: Option,
        local: Option | None,
        deadline: float,
        start: float,
        deferrable: bool,
        reason: str,
    ) -> InferResponse:
        mp = self.policy.model_policy(model)
        assert choice.transport is not None and mp.cloud_model is not None
        transport = self.transports[choice.transport]
        cloud_deadline, local = fallback_plan(time.monotonic(), deadline, local, choice)
        try:
            result = await transport.infer(mp.cloud_model, request, cloud_deadline)
        except InvalidInput:
            raise
        except FerryError as exc:
            now = time.monotonic()
            self.breakers[choice.transport].record_failure(now)
            if isinstance(exc, DeadlineExceeded):
                self.est.link(choice.transport).observe_timeout(choice.up_bytes, now - start, now)
            else:
                self.est.link(choice.transport).observe_failure(now)
            why = f"{choice.name} failed ({exc.code.value}: {exc.message})"
            if local is not None and deadline - now > 0:
                log.info("falling back to local: %s", why)
                return await self._run_local(model, request, local, start, why, fallback=True)
            if deferrable and self.deferrer is not None:
                return await self.deferrer.defer(model, request, deadline_ms=None, reason=why)
            raise
        return self._learn(model, choice, result, start, reason)

    def _learn(
        self, model: str, choice: Option, result: TransferResult, start: float, reason: str
    ) -> InferResponse:
        now = time.monotonic()
        assert choice.transport is not None
        self.breakers[choice.transport].record_success(now)
        params = result.response.parameters
        queue_us = int(params.get("queue_us", 0) or 0)
        compute_us = int(params.get("compute_us", 0) or 0)
        cloud_model = self.policy.model_policy(model).cloud_model or model
        self.est.observe_reply(cloud_model, queue_us, compute_us, now)
        self.est.link(choice.transport).observe(
            result.sent_bytes,
            result.received_bytes,
            result.elapsed_s,
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
            **_provenance(
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
        self, model: str, request: InferRequest, deadline: float, start: float, deferrable: bool
    ) -> InferResponse:
        mp = self.policy.model_policy(model)
        local_opt = self.policy.local_option(mp)
        local_answer = await self._run_local(
            model, request, local_opt, start, "cascade: local first"
        )
        scores = local_answer.outputs[0].data
        if mp.cascade_output:
            scores = local_answer.output(mp.cascade_output).data
        conf = min(
            confidence(row)
            for row in np.asarray(scores).reshape(scores.shape[0] if scores.ndim > 1 else 1, -1)
        )
        local_answer.parameters["confidence"] = round(conf, 4)
        if not self.policy.cascade_offload(model, conf):
            return local_answer
        now = time.monotonic()
        decision = self.decide(model, request, deadline - now, mode="cloud")
        if decision.choice is None:
            local_answer.parameters["cascade"] = (
                f"unsure ({conf:.2f}) but no cloud: {decision.reason}"
            )
            return local_answer
        try:
            answer = await self._offload(
                model,
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

    async def probe(self) -> None:
        """Refresh stale link estimates and give open breakers their trial."""
        now = time.monotonic()
        stale = set(self.est.stale_links(now, 30.0))
        for name, transport in self.transports.items():
            breaker = self.breakers[name]
            if breaker.state == "closed" and name not in stale:
                continue
            if breaker.state != "closed" and not breaker.allow(now):
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
            self.est.link(name).observe_probe(rtt, t)


def _provenance(
    where: str,
    option: Option | None,
    actual_s: float,
    energy_j: float,
    sent: int,
    received: int,
    reason: str,
    fallback: bool,
    **extra: Any,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "where": where,
        "latency_ms": round(actual_s * 1000, 3),
        "predicted_latency_ms": round(option.latency_s * 1000, 3) if option else None,
        "energy_j": round(energy_j, 6),
        "bytes_sent": sent,
        "bytes_received": received,
        "fallback": fallback,
        "decision": reason,
    }
    if params["predicted_latency_ms"] is None:
        del params["predicted_latency_ms"]
    params.update(extra)
    return params


__all__ = ["DeadlineExceeded", "EdgeDataPlane"]
