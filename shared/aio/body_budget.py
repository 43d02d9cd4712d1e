"""HTTP request bodies charged to a :class:`~shared.admission.ByteBudget` as they come.

Both tiers' HTTP fronts share it: a body is refused from its head where the
bytes already in flight leave no room for it, charged a first slice at the
head and more (x4 each time) ahead of what arrives, and its inflated size
when it was compressed; all of it is given back once the answer is written.
A client that declares 16 MB and trickles holds the first slice only.
"""

from __future__ import annotations

from shared.admission import FIRST_TAKE, ByteBudget
from shared.aio.http_server import Request, Response, ferry_error_response


class BodyBudget:
    """The four hooks of a front for its ``budget`` (``max_body_bytes``: what a body
    without a Content-Length may grow to)."""

    def __init__(self, budget: ByteBudget, max_body_bytes: int) -> None:
        self.budget = budget
        self.max_body_bytes = max_body_bytes

    def admit(self, request: Request) -> Response | None:
        """From the head: a refusal, or None with the first slice taken."""
        if not request.has_body:
            return None
        declared = request.content_length
        whole = declared if declared is not None else self.max_body_bytes
        if not self.budget.fits(whole):
            return ferry_error_response(self.budget.overloaded(whole))
        taken = min(whole, FIRST_TAKE)
        if not self.budget.try_take(taken):
            return ferry_error_response(self.budget.overloaded(taken))
        request.state["taken"] = taken
        if taken < whole:
            request.state["whole"] = whole
            request.allowance = taken
        return None

    def receiving(self, request: Request, received: int) -> Response | None:
        """Takes the budget ahead of the body, a few times per body (x4 each time)."""
        state = request.state
        whole, taken = state["whole"], state["taken"]
        more = min(whole, max(4 * taken, 2 * received)) - taken
        if not self.budget.try_take(more, held=taken):
            return ferry_error_response(self.budget.overloaded(more))
        state["taken"] = taken = taken + more
        request.allowance = taken if taken < whole else None
        return None

    def inflated(self, request: Request, size: int) -> None:
        """A compressed body's inflated bytes are charged too (they are what memory holds)."""
        held = request.state.get("taken", 0)
        more = size - held
        if more > 0:
            if not self.budget.try_take(more, held=held):
                raise self.budget.overloaded(more)
            request.state["taken"] = held + more

    def finished(self, request: Request) -> None:
        taken = request.state.pop("taken", 0)
        if taken:
            self.budget.give(taken)
