"""Start a coroutine at once, in the caller's turn of the loop, and make it a task only if it waits.

Python 3.12's eager task factory does this for a whole loop; Ferry runs on 3.11
too, and wants it only where a request's handler usually finishes without
waiting (a lone request to an idle model answers in place): there, a task
costs its creation and one more loop turn per request, a tenth of a small
offload's round trip on these machines.  On 3.12+ this is one eager task (the
task is current while its first step runs, as asyncio.timeout needs); on 3.11
the first step runs bare, which 3.11's wait_for allows.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")

_EAGER_TASKS = sys.version_info >= (3, 12)


def eager_future(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]
) -> asyncio.Future[T]:
    """Run ``coro`` up to its first wait: its outcome as a future, already done when it
    finished without waiting, else the task carrying it on.

    It runs in a copy of the current context, as a task would, and the task
    that carries it on keeps that context.  The caller must not be inside a
    coroutine that this one could wait for (it would wait for itself).
    """
    context = contextvars.copy_context()
    if _EAGER_TASKS:
        # Python 3.12+ runs a task's first step in place itself, with the task current:
        # asyncio.timeout (under wait_for there) refuses to run where no task is, and
        # the bare first step below ran in the caller's task, or in none from a protocol
        # callback, so every offload from the agent's API answered 500.
        return asyncio.Task(coro, loop=loop, context=context, eager_start=True)
    try:
        waited = context.run(coro.send, None)
    except StopIteration as stop:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(stop.value)
        return done
    except asyncio.CancelledError:
        done = loop.create_future()
        done.cancel()
        return done
    except Exception as exc:
        done = loop.create_future()
        done.set_exception(exc)
        return done
    return loop.create_task(_CarryOn(coro, waited), context=context)


class _CarryOn(Coroutine[Any, Any, T]):
    """``coro`` driven on from the future it first yielded, as its own task would have.

    The task's first step gets that future (still marked blocking, so the task
    waits for it); every later step, and a cancellation even before the first,
    goes straight to ``coro``, which is suspended where it waits.
    """

    __slots__ = ("_coro", "_waited")

    def __init__(self, coro: Coroutine[Any, Any, T], waited: Any) -> None:
        self._coro = coro
        self._waited: Any = waited

    def send(self, value: Any) -> Any:
        waited = self._waited
        if waited is not _GONE:
            self._waited = _GONE
            return waited
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._waited = _GONE
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover - asyncio throws one argument

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, Any, T]:  # pragma: no cover - tasks drive it
        raise TypeError("a carried-on coroutine is driven by its task only")


_GONE = object()


def retrieved(future: asyncio.Future[Any]) -> None:
    """A done callback that reads a future's outcome nobody else will: asyncio logs an
    exception never read at ERROR ("Future exception was never retrieved")."""
    if not future.cancelled():
        future.exception()
