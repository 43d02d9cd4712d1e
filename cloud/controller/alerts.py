"""Utilisation alerts: models that use far less, or more, than they were given.

Once models share servers, the costly mistakes are quiet: a model declared at
500 requests/s that gets 5 holds copies (and memory) others need; a model whose
traffic grew past its plan queues up before anyone re-sizes it.  Per model,
the tracker compares the rate its copies were planned for with the rate
measured at its nodes, averaged over a window, and flags it when the ratio
stays outside ``[low, high]``.  Pure: samples and a clock in, alerts out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cloud.placement.types import Placement

OVER = "over-provisioned"
UNDER = "under-provisioned"
UNPLACED = "unplaced"


#: Planned rates below this (a request every 100 s) are no plan to hold a model to: an
#: idle model loaded on its first request (planned ~0) was told "lower min_copies".
MIN_PLANNED_RATE = 0.01


@dataclass(frozen=True)
class AlertSettings:
    window_s: float = 60.0
    low: float = 0.25  # measured / planned below this: over-provisioned
    high: float = 1.25  # above this: under-provisioned (past the re-placement tolerance)
    min_samples: int = 3  # a window needs this many samples before it speaks
    max_models: int = 10_000  # bound on tracked models


@dataclass(frozen=True)
class Alert:
    model: str
    kind: str
    utilisation: float | None
    planned_rate: float
    observed_rate: float
    message: str

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "kind": self.kind,
            "utilisation": None if self.utilisation is None else round(self.utilisation, 3),
            "planned_rate": round(self.planned_rate, 3),
            "observed_rate": round(self.observed_rate, 3),
            "message": self.message,
        }


class UtilisationTracker:
    def __init__(self, settings: AlertSettings | None = None) -> None:
        self.settings = settings or AlertSettings()
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}

    def observe(self, now: float, model: str, observed: float, planned: float) -> None:
        samples = self._samples.get(model)
        if samples is None:
            if len(self._samples) >= self.settings.max_models:
                return
            samples = self._samples[model] = deque(maxlen=1024)
        if samples and abs(samples[-1][2] - planned) > 1e-9 * max(planned, 1.0):
            # a new plan: the window judges it alone (averaged with the samples taken
            # before the first placement, planned 0, it had read 10 req/s planned as 4)
            samples.clear()
        samples.append((now, observed, planned))
        while samples and samples[0][0] < now - self.settings.window_s:
            samples.popleft()

    def _spans(self, model: str) -> bool:
        """Whether the model's samples cover half a window: three samples taken within a
        second of a placement had raised an alert long before the window said anything."""
        samples = self._samples.get(model)
        return bool(samples) and samples[-1][0] - samples[0][0] >= self.settings.window_s / 2

    def forget(self, keep: set[str]) -> None:
        for model in list(self._samples):
            if model not in keep:
                del self._samples[model]

    def window(self, model: str) -> tuple[float, float, int]:
        """(mean observed rate, mean planned rate, samples) over the window."""
        samples = self._samples.get(model, ())
        if not samples:
            return 0.0, 0.0, 0
        observed = sum(s[1] for s in samples) / len(samples)
        planned = sum(s[2] for s in samples) / len(samples)
        return observed, planned, len(samples)

    def utilisation(self, model: str) -> float | None:
        observed, planned, _ = self.window(model)
        return observed / planned if planned > 0 else None

    def alerts(self, placement: Placement | None) -> list[Alert]:
        found: list[Alert] = []
        s = self.settings
        for model in sorted(self._samples):
            observed, planned, count = self.window(model)
            if count < s.min_samples or planned < MIN_PLANNED_RATE or not self._spans(model):
                continue
            ratio = observed / planned
            if ratio < s.low:
                found.append(
                    Alert(
                        model,
                        OVER,
                        ratio,
                        planned,
                        observed,
                        f"{model}: {observed:.2f} req/s measured against {planned:.2f} planned "
                        f"({ratio:.0%}); lower placement.rate or min_copies",
                    )
                )
            elif ratio > s.high:
                found.append(
                    Alert(
                        model,
                        UNDER,
                        ratio,
                        planned,
                        observed,
                        f"{model}: {observed:.2f} req/s measured against {planned:.2f} planned "
                        f"({ratio:.0%}); more copies or nodes needed",
                    )
                )
        if placement is not None:
            for model, why in sorted(placement.unplaced.items()):
                if why == "idle":
                    continue
                observed, _, _ = self.window(model)
                found.append(Alert(model, UNPLACED, None, 0.0, observed, f"{model}: {why}"))
        return found
