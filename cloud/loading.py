"""What the dataplane does while it loads a model version, off the event loop.

Three node-wide concerns live here:

- **Memory per model** is an *estimate*: the growth of the process while the
  version's sessions are created and run once on zeros (ONNX Runtime and
  OpenVINO allocate most of their buffers at the first run, not at load).
  The figure is the larger of the resident-set growth (``/proc/self/statm``)
  and the growth of bytes held by ``malloc`` (glibc's ``mallinfo2``, which
  still counts memory that re-used freed pages and so never moved the RSS).
  Loads run one at a time under a node-wide lock so two loads never count
  each other's memory; batches of other models running meanwhile still add
  noise, which is why it is an estimate.
- **Warm-up**: that first run happens here, once per session, so the first
  real request does not pay for lazy allocation and kernel selection.  A
  model that rejects an all-zeros input still loads (the warm-up is skipped
  with a warning).
- **Threads**: a model whose config sets no ``[runtime] threads`` gets
  ``max(1, cores // sessions on the node)`` intra-op threads per session,
  counted at load time (the sessions already loaded plus the ones being
  built, or the number planned for the whole start-up set when larger), so
  N sessions do not each spin up a thread per core.  Sessions loaded earlier
  keep their count until they are reloaded.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
import time

import numpy as np

from shared.pipeline import sample_inputs
from shared.repository import ModelConfig
from shared.runtimes.base import Session

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> object | None:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


class MemoryProbe:
    """Readings of the process's resident set and malloc'd bytes."""

    def __init__(self) -> None:
        self._mallinfo = _mallinfo2()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def read(self) -> tuple[int, int]:
        """(resident bytes, bytes in use by malloc); 0 where unknown."""
        rss = 0
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            pass
        heap = 0
        if self._mallinfo is not None:
            info = self._mallinfo()  # type: ignore[operator]
            heap = int(info.uordblks + info.hblkhd)
        return rss, heap

    @staticmethod
    def growth(before: tuple[int, int], after: tuple[int, int]) -> int:
        return max(after[0] - before[0], after[1] - before[1], 0)


def warm_up(session: Session, config: ModelConfig) -> bool:
    """Run ``session`` once on zeros; False (and a warning) when the model rejects them."""
    try:
        session.run(sample_inputs(session, config))
    except Exception as exc:
        log.warning("model %s: warm-up run on zeros failed (%s); loaded anyway", config.name, exc)
        return False
    return True


def outputs_follow_batch(session: Session, config: ModelConfig) -> bool | None:
    """Whether every output of a 2- and a 3-item batch has 2 and 3 as its first dimension.

    Dynamic batching concatenates requests along dim 0 and cuts the outputs
    back along dim 0.  A model whose outputs are not batch-major (a transpose,
    a flattened or pooled output) fails that cut for most batch sizes, but
    one whose size happens to match would hand one client another's rows: runs
    of two and three items at load tell (dynamic inner dims are 1, so a dim
    that moved shows, and one fixed dim cannot equal both).  None: a run
    failed and says nothing (the warm-up has warned).
    """
    base = sample_inputs(session, config, 1)
    for n in (2, 3):
        inputs = {}
        for name, arr in base.items():
            if arr.ndim == 0:
                return None
            inputs[name] = np.concatenate([arr[:1]] * n)
        try:
            out = session.run(inputs)
        except Exception:
            return None
        if not all(a.ndim >= 1 and a.shape[0] == n for a in out.values()):
            return False
    return True


#: a batch-1 run at least this long gains from more intra-op threads (a smaller model's
#: parallel sections cost more to synchronise than they save: a 1 KB identity ran slower)
LONE_MIN_RUN_S = 0.0005
#: beside several instances, a lone session only for a model whose batch-1 run is at
#: most this: it holds every instance while it runs, so a request arriving meanwhile
#: waits out that run (a long one had kept a second request waiting beside an idle
#: instance; a short one is the c=1 latency the lone session is for)
LONE_MAX_SHARED_RUN_S = 0.02


def batch1_run_s(session: Session, config: ModelConfig, runs: int = 5) -> float:
    """Median seconds of a warm batch-1 run on ``session`` (inf when it cannot run)."""
    inputs = sample_inputs(session, config)
    times = []
    try:
        for _ in range(runs + 1):
            start = time.perf_counter()
            session.run(inputs)
            times.append(time.perf_counter() - start)
    except Exception:
        return float("inf")
    return statistics.median(times[1:])


def session_threads(config: ModelConfig, cores: int, sessions_on_node: int) -> int:
    """Intra-op threads for each session of ``config`` (its own setting wins)."""
    if config.runtime.threads:
        return config.runtime.threads
    return max(1, cores // max(1, sessions_on_node))


def planned_sessions(config: ModelConfig, versions: int) -> int:
    return max(1, versions) * config.instance_group.count
