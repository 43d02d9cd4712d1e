"""The vocabulary of placement: what a model needs, what a node offers, where copies go.

Shared by tuning (which measures :class:`LatencyProfile`), the packer (pure
functions over these types), the controller (which publishes a
:class:`Placement`) and the nodes (which follow it).  Everything here is plain
data with a JSON/MessagePack-friendly ``to_dict``/``from_dict``, so the same
objects travel on the broker and sit in tests.

Units: seconds, requests per second, bytes.  A node runs one dynamic batcher
per model it hosts, and their batches share its cores
(:mod:`cloud.placement.serving`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.errors import ConfigError


@dataclass(frozen=True)
class LatencyProfile:
    """``l(b) = a_s + beta_s * b`` for one model on one backend (with ``threads``),
    measured by ``ferry-cloud tune`` on a node of speed 1.0."""

    backend: str
    a_s: float
    beta_s: float
    max_batch: int
    memory_bytes: int
    threads: int = 0
    spread_s: float = 0.0  # residual standard deviation of the fit

    def latency(self, batch: float, speed: float = 1.0) -> float:
        return (self.a_s + self.beta_s * batch) / speed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyProfile:
        # A hand-edited profiles file is the input here: NaN, infinity, negative memory
        # and fractional batches had all been taken (a negative memory let two 3 GiB
        # models onto a 4 GiB node).
        try:
            backend = data["backend"]
            if not isinstance(backend, str) or not backend:
                raise ValueError(f"backend must be a backend's name, got {backend!r}")
            profile = cls(
                backend=backend,
                a_s=_number(data["a_s"], "a_s", least=0.0),
                beta_s=_number(data["beta_s"], "beta_s", above=0.0),
                max_batch=_whole(data["max_batch"], "max_batch", least=1),
                memory_bytes=_whole(data["memory_bytes"], "memory_bytes", least=0),
                threads=_whole(data.get("threads", 0), "threads", least=0),
                spread_s=_number(data.get("spread_s", 0.0), "spread_s", least=0.0),
            )
        except KeyError as exc:  # (its text alone was "'beta_s'")
            raise ConfigError(f"latency profile {data!r}: key {exc} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"latency profile {data!r}: {exc}") from None
        return profile


def _number(value: Any, key: str, least: float | None = None, above: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number > 1e12:
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if (least is not None and number < least) or (above is not None and number <= above):
        bound = f">= {least}" if least is not None else f"> {above}"
        raise ValueError(f"{key} must be {bound}, got {value!r}")
    return number


def _whole(value: Any, key: str, least: int) -> int:
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    if not least <= value <= 1 << 62:
        raise ValueError(f"{key} must be at least {least}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ModelDemand:
    """One model as the packer sees it: its load, its objective, where it can run."""

    name: str
    rate: float  # requests per second (observed or declared)
    slo_s: float  # latency objective on the server: arrival to answer
    profiles: tuple[LatencyProfile, ...]  # one per backend it may run on
    min_copies: int = 1  # 0: may be left unloaded while it has no traffic
    max_copies: int = 0  # 0: no cap beyond one copy per node
    avoid: frozenset[str] = frozenset()  # nodes where it failed to load

    def __post_init__(self) -> None:
        # (the packer's input is checked where it enters: config, profiles, statuses;
        # this catches what slipped past, before it could loop or divide by zero)
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise ValueError(f"model {self.name!r}: rate must be finite and >= 0: {self.rate}")
        if not (math.isfinite(self.slo_s) and self.slo_s > 0):
            raise ValueError(f"model {self.name!r}: slo_s must be finite and > 0: {self.slo_s}")
        if self.min_copies < 0 or self.max_copies < 0:
            raise ValueError(f"model {self.name!r}: min_copies and max_copies must be >= 0")

    def profile_for(self, backend: str) -> LatencyProfile | None:
        for p in self.profiles:
            if p.backend == backend:
                return p
        return None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["profiles"] = [p.to_dict() for p in self.profiles]
        data["avoid"] = sorted(self.avoid)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelDemand:
        try:
            return cls(
                name=str(data["name"]),
                rate=float(data["rate"]),
                slo_s=float(data["slo_s"]),
                profiles=tuple(LatencyProfile.from_dict(p) for p in data["profiles"]),
                min_copies=int(data.get("min_copies", 1)),
                max_copies=int(data.get("max_copies", 0)),
                avoid=frozenset(str(n) for n in data.get("avoid", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model demand {data!r}: {exc}") from None


@dataclass(frozen=True)
class NodeSpec:
    """One server: the memory models may take, the backends it can run, its speed
    relative to the machine the profiles were measured on."""

    name: str
    memory_bytes: int
    backends: frozenset[str]
    speed: float = 1.0
    cores: int = 0
    gpu: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"node {self.name!r}: speed must be finite and > 0: {self.speed}")
        if self.memory_bytes < 0 or self.cores < 0:
            raise ValueError(f"node {self.name!r}: memory_bytes and cores must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["backends"] = sorted(self.backends)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeSpec:
        try:
            return cls(
                name=str(data["name"]),
                memory_bytes=int(data["memory_bytes"]),
                backends=frozenset(str(b) for b in data["backends"]),
                speed=float(data.get("speed", 1.0)),
                cores=int(data.get("cores", 0)),
                gpu=data.get("gpu"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"node spec {data!r}: {exc}") from None


@dataclass(frozen=True)
class Copy:
    """One loaded copy of a model on a node, with the share of traffic it is sized for."""

    model: str
    node: str
    backend: str
    rate: float  # requests per second this copy is planned for
    batch: int  # its mean batch at the share of the node it is planned to get
    duty_cycle_s: float  # how long that batch runs at that share (its own batch cycle)
    occupancy: float  # share of the node's time this copy keeps busy
    memory_bytes: int
    threads: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Copy:
        try:
            return cls(
                model=str(data["model"]),
                node=str(data["node"]),
                backend=str(data["backend"]),
                rate=float(data["rate"]),
                batch=int(data["batch"]),
                duty_cycle_s=float(data["duty_cycle_s"]),
                occupancy=float(data["occupancy"]),
                memory_bytes=int(data["memory_bytes"]),
                threads=int(data.get("threads", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"placement copy {data!r}: {exc}") from None


@dataclass(frozen=True)
class Bounds:
    """Lower bounds on the nodes any placement needs (DESIGN.md section 5)."""

    compute: int
    memory: int

    @property
    def nodes(self) -> int:
        return max(self.compute, self.memory)


@dataclass(frozen=True)
class Placement:
    """Where every copy runs.  ``generation`` grows with every published change."""

    copies: tuple[Copy, ...] = ()
    unplaced: dict[str, str] = field(default_factory=dict)  # model -> why
    generation: int = 0
    bounds: Bounds | None = None

    def copies_of(self, model: str) -> list[Copy]:
        return [c for c in self.copies if c.model == model]

    def on_node(self, node: str) -> list[Copy]:
        return [c for c in self.copies if c.node == node]

    def models(self) -> set[str]:
        return {c.model for c in self.copies}

    def nodes_used(self) -> set[str]:
        return {c.node for c in self.copies}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "generation": self.generation,
            "copies": [c.to_dict() for c in self.copies],
            "unplaced": dict(self.unplaced),
        }
        if self.bounds is not None:
            data["bounds"] = {"compute": self.bounds.compute, "memory": self.bounds.memory}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Placement:
        try:
            bounds = data.get("bounds")
            return cls(
                copies=tuple(Copy.from_dict(c) for c in data.get("copies", [])),
                unplaced={str(k): str(v) for k, v in dict(data.get("unplaced", {})).items()},
                generation=int(data.get("generation", 0)),
                bounds=Bounds(int(bounds["compute"]), int(bounds["memory"])) if bounds else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"placement: {exc}") from None
