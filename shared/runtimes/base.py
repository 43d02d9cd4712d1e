"""The one interface every model backend implements.

A backend loads one model version into a :class:`Session`; the dataplanes of
both tiers only ever talk to that interface, so adding a backend never touches
batching or transport code.  Sessions must release the GIL while computing
(every supported runtime does) because batches run in worker threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, V2 datatype and dims (-1 marks a dynamic dimension).

    ``ranked`` False: the model file says nothing of the tensor's shape (an
    ONNX value with no shape, an OpenVINO port of dynamic rank), so the
    runtime takes any rank and ``dims`` is empty.  Reading that as a scalar
    refused every request the runtime would run; a config's declared dims
    fix the rank instead (as Triton does for such tensors).
    """

    name: str
    datatype: str
    dims: tuple[int, ...]
    ranked: bool = True
    #: a config's only: the shape the model file takes it in (Triton's ``reshape``;
    #: :mod:`shared.runtimes.reshape`), None where it is the dims
    reshape: tuple[int, ...] | None = None

    def sample_dims(self) -> tuple[int, ...]:
        """Dims for a made-up input (a warm-up, a profile): dynamic ones 1, any rank [1]
        (a fixed 0 stays 0: made 1, every warm-up of such a model failed)."""
        if not self.ranked:
            return (1,)
        return tuple(d if d >= 0 else 1 for d in self.dims)

    def shown_dims(self) -> list[int]:
        """Dims as V2 metadata and Triton configs show them: any rank as [-1]
        (neither format can say "any rank"; [-1] at least says it is not fixed)."""
        return list(self.dims) if self.ranked else [-1]


@dataclass(frozen=True)
class RuntimeOptions:
    """How to build a session.

    ``threads`` is the intra-op thread count; ``None`` means the cores this
    process may use (``os.sched_getaffinity``).  Spinning is off by default:
    on small machines spinning threads of two sessions starve each other.
    """

    threads: int | None = None
    device: str = "cpu"
    precision_hint: str | None = None
    allow_spinning: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def resolved_threads(self) -> int:
        if self.threads and self.threads > 0:
            return self.threads
        return available_cpus()


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@runtime_checkable
class Session(Protocol):
    """A loaded model version, ready to run batches."""

    backend: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; returns the requested outputs (all when None)."""
        ...

    def close(self) -> None:
        """Free the runtime's memory; the session is unusable afterwards."""
        ...


class Cancel:
    """A stop signal for one run, given from another thread (the event loop).

    A session that can stop a run halfway (:func:`cancellable`) offers
    ``run_cancellable(inputs, outputs, cancel)``: it binds a hook here before it
    starts, and :meth:`cancel` calls it; the run then ends with
    :class:`~shared.errors.RunCancelled`.  A run cancelled before it started
    does not start.  The edge agent stops a race's local run this way when the
    cloud answers first: the device then spends only the part it ran.
    """

    __slots__ = ("_hook", "_lock", "cancelled")

    def __init__(self) -> None:
        self.cancelled = False
        self._hook: Callable[[], Any] | None = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            hook, self._hook = self._hook, None
        if hook is not None:
            hook()

    def bind(self, hook: Callable[[], Any]) -> bool:
        """The runtime's way to stop the run about to start; False: cancelled already."""
        with self._lock:
            if self.cancelled:
                return False
            self._hook = hook
            return True


def cancellable(session: object) -> bool:
    """Whether ``session`` can stop a run halfway (``run_cancellable``)."""
    return bool(getattr(session, "cancellable", False))


class Backend(Protocol):
    """A module in shared/runtimes/ exposes ``load(path, options) -> Session``."""

    def load(self, path: Path, options: RuntimeOptions) -> Session: ...
