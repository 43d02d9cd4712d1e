"""One thread per runtime session, handed work from the event loop (both tiers).

:class:`SessionThread` replaces a ``ThreadPoolExecutor`` hand-off: the pool's
``submit`` takes two locks and a Python-level semaphore (``_idle_semaphore``),
then chains a ``concurrent.futures.Future`` to an asyncio one.  Measured on
the cloud node, that hand-off was a quarter of the interpreter's time per
request on a near-free model.  Here a run is one ``SimpleQueue.put`` (C) to
the session's own thread, and its outcome one ``call_soon_threadsafe`` back.
The cloud's batcher and the agent's local models both run on it.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

Done = Callable[[Any, BaseException | None], None]

#: how long a busy worker may keep the GIL before the event loop gets its turn
LOOP_SWITCH_S = 0.001


def favour_the_loop(interval_s: float = LOOP_SWITCH_S) -> None:
    """Shorten CPython's GIL switch interval (5 ms) for a process that runs a loop.

    A worker thread parsing a big BYTES body or encoding a JSON answer holds
    the GIL; the loop gets it back only at the switch interval, and a probe
    that needs it several times waited ~5 ms each time (50 ms stalls
    measured).  Runtimes release the GIL while they compute, so a shorter
    interval costs them nothing.  Called from a server's ``main``, never at
    import.
    """
    sys.setswitchinterval(interval_s)


#: every live session thread, for the exit hook
_LIVE: weakref.WeakSet[SessionThread] = weakref.WeakSet()
_HOOKED: list[bool] = []
#: how long interpreter exit waits for runs still in a runtime call
EXIT_WAIT_S = 30.0


def _finish_runs() -> None:
    """At interpreter exit: let every session thread end after the run it is in.

    The threads are daemons (an exit must not wait on an idle one blocked in
    ``get``), but one inside a runtime call must not have the runtime torn
    down under it (that aborts the process), so exit waits for those, bounded.
    """
    deadline = time.monotonic() + EXIT_WAIT_S
    threads = list(_LIVE)
    for t in threads:
        t.stop()
    for t in threads:
        t._thread.join(max(0.0, deadline - time.monotonic()))


class SessionThread:
    """Runs what it is given in order on its own thread; reports each outcome on the loop."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[
            tuple[Callable[..., Any], tuple, Done, asyncio.Future[Any] | None] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)
        if not _HOOKED:  # once, on first use (no import-time side effects)
            _HOOKED.append(True)
            atexit.register(_finish_runs)

    def submit(self, fn: Callable[..., Any], args: tuple, done: Done) -> None:
        """``done(result, None)`` or ``done(None, error)`` is called on the loop."""
        self._queue.put((fn, args, done, None))

    def run(
        self, fn: Callable[..., Any], *args: Any, finished: Callable[[], None] | None = None
    ) -> asyncio.Future[Any]:
        """``fn(*args)`` on this thread; a future of its result, resolved on the loop.

        Cancelling the future before the thread reaches the run skips it: a caller
        that gave up (cancelled, past its deadline) had still had its run made, in
        the place of the requests queued behind it.  ``finished()`` is called on the
        loop once the thread is done with it, run or skipped (what it holds is
        freed then: a queue bound counts it until that moment)."""
        future: asyncio.Future[Any] = self._loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            if finished is not None:
                finished()
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._queue.put((fn, args, done, future))
        return future

    def stop(self) -> None:
        """The thread ends after what it was already given."""
        self._queue.put(None)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, done, future = item
            if future is not None and future.cancelled():
                del item, fn, args, future
                try:  # (its caller is gone; its ``finished`` still hears it)
                    self._loop.call_soon_threadsafe(done, None, None)
                except RuntimeError:
                    return
                del done
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # delivered to the loop, which answers the requests
                result, error = None, exc
            try:
                self._loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            # Let go of this run while waiting for the next: the requests it held (and the
            # body buffers their tensors view) must be free to be reused or released now.
            del item, fn, args, done, future, result, error
