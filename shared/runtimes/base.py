"""The one interface every model backend implements.

A backend loads one model version into a :class:`Session`; the dataplanes of
both tiers only ever talk to that interface, so adding a backend never touches
batching or transport code.  Sessions must release the GIL while computing
(every supported runtime does) because batches run in worker threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, V2 datatype and dims (-1 marks a dynamic dimension)."""

    name: str
    datatype: str
    dims: tuple[int, ...]


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


class Backend(Protocol):
    """A module in shared/runtimes/ exposes ``load(path, options) -> Session``."""

    def load(self, path: Path, options: RuntimeOptions) -> Session: ...
