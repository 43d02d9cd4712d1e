"""Local models on the device: sessions from the local repository.

Each model gets one session and one thread (:class:`SessionThread`; runtimes
release the GIL), so a long local inference never blocks the agent's event loop and two
local models do not spin on the same cores at once.  A model whose recent
runs all took under ``inline_us`` runs in place when nothing else waits for
it: the hand-off would cost more than the run (:mod:`shared.runtimes.inline`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shared.aio.threads import SessionThread
from shared.errors import (
    DeadlineExceeded,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    RunCancelled,
    ShuttingDown,
)
from shared.pipeline import open_session
from shared.repository import ModelConfig, ModelRepository, complete_config
from shared.repository.capacity import NodeCapacity, check_capacity, model_file_bytes
from shared.runtimes import RuntimeOptions, Session
from shared.runtimes.base import Cancel, cancellable
from shared.runtimes.inline import InlineGate, input_bytes


@dataclass
class LocalModel:
    name: str
    version: int
    config: ModelConfig
    session: Session
    gate: InlineGate
    thread: SessionThread | None = None  # started on the first run that needs it

    def run_sync(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel | None = None
    ) -> tuple[dict[str, np.ndarray], float]:
        start = time.perf_counter()
        if cancel is not None and cancellable(self.session):
            result = self.session.run_cancellable(inputs, outputs, cancel)  # type: ignore[attr-defined]
        else:
            result = self.session.run(inputs, outputs)
        return result, time.perf_counter() - start

    def close(self) -> None:
        """Stop its thread and free its session (blocking: joins the thread)."""
        if self.thread is not None:
            self.thread.stop()
            self.thread.join()
        self.session.close()


class LocalModels:
    def __init__(
        self,
        repository: ModelRepository,
        threads: int = 0,
        slowdown: float = 1.0,
        latency_floor_s: float = 0.0,
        max_backlog: int = 256,
        inline_us: float = 0.0,
    ) -> None:
        self.repository = repository
        self.inline_us = inline_us
        self.max_backlog = max_backlog
        self.threads = threads
        self.slowdown = slowdown
        self.latency_floor_s = latency_floor_s
        self._models: dict[str, LocalModel] = {}
        self._backlog: dict[str, int] = {}
        #: runs handed to each model's thread and not yet run or skipped by it
        self._queued: dict[str, int] = {}
        self._emulated: dict[str, asyncio.Lock] = {}
        self._lock = threading.Lock()  # (load runs in a worker thread, close on the loop)
        self._closed = False
        self._stopping = False  # the agent's drain ran out: queued runs are not made

    def backlog(self, name: str) -> int:
        """Requests submitted to ``name`` and not finished (one runs at a time)."""
        return self._backlog.get(name, 0)

    def names(self) -> list[str]:
        return sorted(self._models)

    def has(self, name: str) -> bool:
        return name in self._models

    def cancellable(self, name: str) -> bool:
        """Whether a run of ``name`` can be stopped halfway (its runtime takes a cancel)."""
        model = self._models.get(name)
        return model is not None and cancellable(model.session)

    def get(self, name: str) -> LocalModel:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(f"no local model {name!r}")
        return model

    def load(self, name: str) -> LocalModel:
        """Load the newest selected version (blocking: call off the loop)."""
        if name in self._models:
            return self._models[name]
        config = self.repository.read_config(name)
        versions = self.repository.selected_versions(name, config)
        if not versions:
            why = self.repository.no_versions_why(name)
            raise ModelNotFound(f"local model {name!r} cannot load: {why}")
        version = versions[-1]
        backend, path = self.repository.model_file(name, version, config.backend)
        # The node's bounds hold here too: a folder the cloud refuses by key (100,000
        # threads) had hung the agent's start-up, its memory growing without end.
        # (one session, one version: the agent builds no more whatever the count says)
        one = replace(config, instance_group=replace(config.instance_group, count=1))
        check_capacity(
            one,
            NodeCapacity.detect(),
            str(config.source) if config.source else f"model {name!r}",
            model_bytes=model_file_bytes(path, external=False),
        )
        options = config.runtime.to_options(device=config.instance_group.kind)
        if self.threads:
            options = RuntimeOptions(
                threads=self.threads,
                device=options.device,
                precision_hint=options.precision_hint,
                allow_spinning=options.allow_spinning,
            )
        session = open_session(backend, path, options, config)
        model = LocalModel(
            name,
            version,
            complete_config(config, session),
            session,
            InlineGate(self.inline_us),
        )
        with self._lock:
            if self._closed:  # closed while this loaded (a reload cut short by a stop)
                model.close()
                raise ModelNotReady(f"local model {name!r}: the agent is stopping")
            self._models[name] = model
        return model

    async def run(
        self,
        name: str,
        inputs: dict[str, np.ndarray],
        outputs: list[str] | None = None,
        cancel: Cancel | None = None,
        deadline: float | None = None,
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and compute seconds; RunCancelled when ``cancel`` stopped it, and
        DeadlineExceeded when ``deadline`` (monotonic) passed before the run started
        (queued behind others: a late answer is no answer, as a cloud queue says)."""
        model = self.get(name)
        loop = asyncio.get_running_loop()
        waiting = self._backlog.get(name, 0)
        if self._stopping:
            raise _stopped(name)
        _check_deadline(name, deadline, waiting)
        # (runs whose callers gave up stay queued on the thread, holding their inputs,
        # until it skips them: counted against the bound until then)
        ahead = max(waiting, self._queued.get(name, 0))
        bound, what = self.max_backlog, "max"
        # The model's own queue policy holds here as in the cloud (its /config shows it):
        # max_queue_size requests queued besides the one running, and default_timeout_us
        # in the queue at most (a request's own deadline may only shorten it).
        batching = model.config.dynamic_batching
        if batching is not None:
            if batching.max_queue_size and (not bound or batching.max_queue_size + 1 < bound):
                bound, what = batching.max_queue_size + 1, "max_queue_size"
            if batching.default_timeout_us:
                cap = time.monotonic() + batching.default_timeout_us / 1e6
                deadline = cap if deadline is None else min(deadline, cap)
        if bound and ahead >= bound:
            # The session thread's queue is bounded here: past it a request is refused at once
            # instead of queueing work the device cannot finish in anyone's deadline.
            if what == "max_queue_size":  # (Triton's count: queued, the run aside)
                said = f"{ahead - 1} requests queued behind the one running (max_queue_size "
                said += f"{bound - 1})"
            else:
                said = f"{ahead} requests waiting (max {bound})"
            raise Overloaded(f"local model {name!r} has {said}", retry_after=1.0)
        self._backlog[name] = waiting + 1
        try:
            nbytes = input_bytes(inputs)
            if not waiting and model.gate.allows(nbytes):
                result, seconds = model.run_sync(inputs, outputs)
            else:
                if model.thread is None:
                    model.thread = SessionThread(f"local-{name}", loop)
                handed = time.perf_counter_ns()
                started: list[bool] = []

                def run(i: Any, o: Any, c: Any, w: int = waiting) -> Any:
                    started.append(True)
                    if self._stopping:  # (the agent stops: answered at once, not run)
                        raise _stopped(name)
                    _check_deadline(name, deadline, w)  # (in the thread, as it starts)
                    return model.run_sync(i, o, c)

                self._queued[name] = self._queued.get(name, 0) + 1

                def finished() -> None:
                    self._queued[name] = self._queued.get(name, 1) - 1

                future = model.thread.run(run, inputs, outputs, cancel, finished=finished)
                result, seconds = await _queued(future, name, deadline, waiting, started)
                if not waiting:  # a lone run's hand-off: what running it in place saves
                    model.gate.record_hop(time.perf_counter_ns() - handed - int(seconds * 1e9))
            model.gate.record(int(seconds * 1e9), nbytes)
            # Device emulation (AgentConfig.local_slowdown and local_latency_ms):
            # the emulated device runs one request at a time, as the real one would.
            emulated = max(seconds * self.slowdown, self.latency_floor_s)
            if emulated > seconds:
                lock = self._emulated.setdefault(name, asyncio.Lock())
                # (the emulated device's queue: its deadline is kept while waiting for the
                # device, not only checked once the device is free, 100+ ms late)
                if deadline is None:
                    await lock.acquire()
                else:
                    try:
                        await asyncio.wait_for(
                            lock.acquire(), max(0.0, deadline - time.monotonic())
                        )
                    except TimeoutError:
                        _check_deadline(name, deadline, waiting)  # (passed: raises)
                        raise
                try:
                    if self._stopping:
                        raise _stopped(name)
                    _check_deadline(name, deadline, waiting)
                    if cancel is not None and cancellable(model.session):
                        await _emulated_run(loop, emulated - seconds, cancel)
                    else:
                        await asyncio.sleep(emulated - seconds)
                finally:
                    lock.release()
                seconds = emulated
        finally:
            self._backlog[name] -= 1
        return result, seconds

    def stop_queued(self) -> None:
        """The agent stops and its drain ran out: runs not yet started are answered
        ``shutting_down`` at once instead of made, one after another, while the app
        that sent them had been cut off (a 250-deep queue held the exit 37 s)."""
        self._stopping = True

    def take_back(self, name: str) -> LocalModel | None:
        """Withdraw ``name`` unless a run of it is under way (None then): no run can
        start on it after this.  Call on the event loop, where runs start; then
        :meth:`LocalModel.close` it (blocking: off the loop)."""
        model = self._models.get(name)
        if model is None or self._backlog.get(name, 0) or self._queued.get(name, 0):
            return None
        del self._models[name]
        self._backlog.pop(name, None)
        self._queued.pop(name, None)
        self._emulated.pop(name, None)
        return model

    def close(self) -> None:
        with self._lock:
            self._closed = True
            models = list(self._models.values())
            self._models.clear()
        for model in models:
            model.close()


async def _queued(
    future: asyncio.Future[Any],
    name: str,
    deadline: float | None,
    ahead: int,
    started: list[bool],
) -> Any:
    """A queued run's outcome; DeadlineExceeded at ``deadline`` if the run has not
    started by then (it is taken off the queue: it had been made anyway, and its caller
    told only once the thread reached it, seconds late).  A timer, not ``wait_for`` on
    a shield: those took a task's worth of loop turns on every local run."""
    if deadline is None:
        return await future  # (a cancelled caller cancels it: the thread skips it)
    loop = asyncio.get_running_loop()
    late: list[bool] = []

    def expire() -> None:
        if not started and not future.done():  # (a started run is not abandoned)
            late.append(True)
            future.cancel()

    timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), expire)
    try:
        return await future
    except asyncio.CancelledError:
        if late:
            raise DeadlineExceeded(
                f"local model {name!r}: the deadline passed before the run could start "
                f"({ahead} request(s) ahead of it)"
            ) from None
        future.cancel()
        raise
    finally:
        timer.cancel()


def _stopped(name: str) -> ShuttingDown:
    return ShuttingDown(f"local model {name!r}: the agent stopped before this request ran")


def _check_deadline(name: str, deadline: float | None, ahead: int) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded(
            f"local model {name!r}: the deadline passed before the run could start "
            f"({ahead} request(s) ahead of it)"
        )


async def _emulated_run(loop: asyncio.AbstractEventLoop, seconds: float, cancel: Cancel) -> None:
    """The emulated device's extra run time, stopped by ``cancel`` as the runtime would be."""
    stopped = asyncio.Event()
    if not cancel.bind(lambda: loop.call_soon_threadsafe(stopped.set)):
        raise RunCancelled("the emulated local run was cancelled before it started")
    try:
        await asyncio.wait_for(stopped.wait(), seconds)
    except TimeoutError:
        return  # ran its course
    raise RunCancelled("the emulated local run was cancelled")
