"""What a node (or an agent's local API) lets in: request bytes in flight and connections.

:class:`ByteBudget` bounds the bytes of every request received but not yet
answered, HTTP and MQTT together.  A request past it is refused before its
body is read (HTTP, from Content-Length, counting the bytes that did come in
for other bodies), as its body comes (past the budget halfway), once a
compressed body is inflated, or before it is decoded (MQTT), with
"overloaded" + Retry-After, so forty clients sending 60 MB each cannot take
the node's memory.  The HTTP server (:mod:`shared.aio.http_server`) caps
open connections and reaps those that dawdle over a head, a body or between
requests.
"""

from __future__ import annotations

import threading

from shared.errors import Overloaded
from shared.http.wire import FIRST_BODY_BYTES

#: Retry-After for a request refused by the byte budget (bodies drain in about this long)
BUDGET_RETRY_S = 1.0
#: What an HTTP body takes from the budget at its head (the buffer the parser gives it
#: first); the rest as its bytes come.  A client that declares 16 MB and trickles holds
#: this much, so stalled uploads fill the budget no sooner than the connection cap.
FIRST_TAKE = FIRST_BODY_BYTES


class ByteBudget:
    """A thread-safe count of request bytes in flight, against a fixed bound (0: none)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def used(self) -> int:
        return self._used

    def try_take(self, n: int, held: int = 0) -> bool:
        """Take ``n`` more for a request that holds ``held`` already: past the bound only
        where nothing else is in flight (one request of any size is admitted alone)."""
        with self._lock:
            if self.limit and self._used + n > self.limit and self._used > held:
                self.refused += 1
                return False
            self._used += n
            return True

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes would fit now (a look: nothing is taken)."""
        with self._lock:
            if self.limit and self._used + n > self.limit and self._used > 0:
                self.refused += 1
                return False
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used = max(0, self._used - n)

    def overloaded(self, n: int) -> Overloaded:
        return Overloaded(
            f"node has {self._used} bytes of requests in flight; {n} more would pass its "
            f"budget of {self.limit}",
            retry_after=BUDGET_RETRY_S,
        )
