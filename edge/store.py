"""Durable store for deferrable requests (sqlite in WAL mode).

``put`` returns only after the row is committed with ``synchronous=FULL``,
so an acknowledged deferral survives ``kill -9`` and power loss.  A request
is pending -> sending -> delivered (or failed / expired); rows a crash left
in "sending" go back to pending when the store opens (at-least-once; the
request id lets a receiver drop duplicates).  Answers stay in the store for
the app to fetch.

The database opens on the first deferral, or at once when one is left from
an earlier run (its requests must still go out): an agent that never
defers never loads sqlite (~1 MiB resident on a device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import Overloaded

#: the store's order follows the cloud's: priority 1 is the most urgent, and 0
#: (no priority given) goes after every explicit level
_URGENCY = "CASE WHEN priority > 0 THEN priority ELSE 2147483647 END"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS deferred (
    request_id   TEXT PRIMARY KEY,
    model        TEXT NOT NULL,
    payload      BLOB NOT NULL,
    created_wall REAL NOT NULL,
    expires_wall REAL,
    priority     INTEGER NOT NULL DEFAULT 0,
    status       TEXT NOT NULL DEFAULT 'pending',
    attempts     INTEGER NOT NULL DEFAULT 0,
    result       BLOB,
    error        TEXT
);
CREATE INDEX IF NOT EXISTS deferred_pending ON deferred (status, priority, created_wall);
"""


_FINISHED = "('delivered', 'failed', 'expired')"


def db_error() -> type[Exception]:
    """``sqlite3.Error`` for an ``except`` clause: imported only when an exception is
    being matched (an agent that never defers never imports sqlite3)."""
    import sqlite3

    return sqlite3.Error


@dataclass
class DeferredItem:
    request_id: str
    model: str
    payload: bytes
    created_wall: float
    expires_wall: float | None
    priority: int
    attempts: int


@dataclass
class DeferredResult:
    status: str
    result: bytes | None
    error: str | None


class DeferredStore:
    def __init__(self, path: Path, *, max_rows: int = 10_000, max_bytes: int = 256 << 20) -> None:
        """``max_rows`` / ``max_bytes`` bound the requests waiting (pending or sending):
        a deferral past them is refused with "overloaded", never dropped silently.
        They bound the answers kept for the apps too, apart: past them the oldest
        answers are forgotten first (an app that never fetches must not fill the disk
        for ``keep_results_s``).  An answered row keeps its answer, not its request."""
        self.path = Path(path)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._conn: Any = None
        if self.path.exists():
            self._open()

    def _open(self) -> Any:
        import sqlite3

        db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        # a crash while sending counts as an attempt: a request that crashes the agent
        # every time must not loop forever
        db.execute(
            "UPDATE deferred SET status = 'pending', attempts = attempts + 1 WHERE status = 'sending'"
        )
        self._conn = db
        return db

    @property
    def _db(self) -> Any:
        return self._conn if self._conn is not None else self._open()

    @property
    def opened(self) -> bool:
        """Whether anything was ever deferred here (reads of an unopened store are empty)."""
        return self._conn is not None

    def put(
        self,
        model: str,
        payload: bytes,
        *,
        request_id: str,
        created_wall: float,
        expires_wall: float | None,
        priority: int = 0,
    ) -> None:
        import sqlite3

        try:  # disk full, read-only, corrupt: a typed refusal, not a raw sqlite error
            rows, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM deferred"
                " WHERE status IN ('pending', 'sending')"
            ).fetchone()
            if (self.max_rows and rows >= self.max_rows) or (
                self.max_bytes and size + len(payload) > self.max_bytes
            ):
                raise Overloaded(
                    f"the deferred store is full ({rows} requests, {size} bytes waiting; "
                    f"bounds {self.max_rows} requests, {self.max_bytes} bytes)",
                    retry_after=60.0,
                )
            self._db.execute(
                "INSERT OR IGNORE INTO deferred (request_id, model, payload, created_wall,"
                " expires_wall, priority) VALUES (?, ?, ?, ?, ?, ?)",
                (request_id, model, payload, created_wall, expires_wall, priority),
            )
        except sqlite3.Error as exc:
            raise Overloaded(
                f"the deferred store cannot take the request: {exc}", retry_after=60.0
            ) from None

    def pending(self, limit: int = 100, now_wall: float | None = None) -> list[DeferredItem]:
        if not self.opened:
            return []
        rows = self._db.execute(
            "SELECT request_id, model, payload, created_wall, expires_wall, priority, attempts FROM deferred"
            " WHERE status = 'pending' AND (expires_wall IS NULL OR ? IS NULL OR expires_wall > ?)"
            f" ORDER BY {_URGENCY}, created_wall LIMIT ?",
            (now_wall, now_wall, limit),
        ).fetchall()
        return [DeferredItem(r[0], r[1], bytes(r[2]), r[3], r[4], r[5], r[6]) for r in rows]

    def mark_sending(self, request_id: str) -> None:
        self._db.execute(
            "UPDATE deferred SET status = 'sending' WHERE request_id = ?", (request_id,)
        )

    def mark_pending(self, request_id: str, *, attempt: bool = False) -> None:
        """Back to pending; ``attempt`` counts a try the cloud itself failed (a link
        that let the request down is not the request's attempt)."""
        self._db.execute(
            "UPDATE deferred SET status = 'pending', attempts = attempts + ?"
            " WHERE request_id = ? AND status = 'sending'",
            (1 if attempt else 0, request_id),
        )

    def requeue_sending(self) -> int:
        """Rows "sending" with no flush running are stale: back to pending, no attempt."""
        if not self.opened:
            return 0
        return self._db.execute(
            "UPDATE deferred SET status = 'pending' WHERE status = 'sending'"
        ).rowcount

    def mark_delivered(self, request_id: str, result: bytes | None, error: str | None) -> None:
        status = "delivered" if error is None else "failed"
        self._db.execute(
            "UPDATE deferred SET status = ?, result = ?, error = ?, payload = x''"
            " WHERE request_id = ?",
            (status, result, error, request_id),
        )
        self._trim_answers()

    def _trim_answers(self) -> int:
        """Forget the oldest answered, failed and expired rows past the bounds."""
        forgotten = 0
        if self.max_rows:
            forgotten += self._db.execute(
                f"DELETE FROM deferred WHERE request_id IN (SELECT request_id FROM deferred"
                f" WHERE status IN {_FINISHED} ORDER BY created_wall DESC LIMIT -1 OFFSET ?)",
                (self.max_rows,),
            ).rowcount
        if self.max_bytes:
            forgotten += self._db.execute(
                "DELETE FROM deferred WHERE request_id IN (SELECT request_id FROM (SELECT"
                " request_id, SUM(COALESCE(LENGTH(result), 0) + COALESCE(LENGTH(error), 0)"
                " + LENGTH(payload)) OVER (ORDER BY created_wall DESC, request_id) AS held"
                f" FROM deferred WHERE status IN {_FINISHED}) WHERE held > ?)",
                (self.max_bytes,),
            ).rowcount
        return forgotten

    def result(self, request_id: str) -> DeferredResult | None:
        if not self.opened:
            return None
        row = self._db.execute(
            "SELECT status, result, error FROM deferred WHERE request_id = ?", (request_id,)
        ).fetchone()
        if row is None:
            return None
        return DeferredResult(row[0], bytes(row[1]) if row[1] is not None else None, row[2])

    def expire(self, now_wall: float) -> list[str]:
        if not self.opened:
            return []
        rows = self._db.execute(
            "SELECT request_id FROM deferred WHERE status = 'pending' AND expires_wall IS NOT NULL"
            " AND expires_wall <= ?",
            (now_wall,),
        ).fetchall()
        ids = [r[0] for r in rows]
        for request_id in ids:
            self._db.execute(
                "UPDATE deferred SET status = 'expired', error = 'deadline_exceeded: no link before the"
                " deferral expired', payload = x'' WHERE request_id = ?",
                (request_id,),
            )
        if ids:
            self._trim_answers()
        return ids

    def purge(self, before_wall: float) -> int:
        """Forget answered, failed and expired requests created before ``before_wall``.

        Callers pass ``now - ttl - keep``: a request answered at the very end
        of its ttl is still kept for ``keep`` after its answer.
        """
        if not self.opened:
            return 0
        cur = self._db.execute(
            f"DELETE FROM deferred WHERE status IN {_FINISHED} AND created_wall < ?",
            (before_wall,),
        )
        return cur.rowcount

    def counts(self) -> dict[str, int]:
        if not self.opened:
            return {}
        return dict(
            self._db.execute("SELECT status, COUNT(*) FROM deferred GROUP BY status").fetchall()
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
