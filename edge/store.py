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

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError, Overloaded, PayloadTooLarge

log = logging.getLogger(__name__)

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
    error        TEXT,
    answered_wall REAL,
    owner        TEXT NOT NULL DEFAULT '',
    app_id       TEXT
);
CREATE INDEX IF NOT EXISTS deferred_pending ON deferred (status, priority, created_wall);
CREATE TABLE IF NOT EXISTS clock (
    id     INTEGER PRIMARY KEY CHECK (id = 0),
    boot   TEXT,
    offset REAL NOT NULL,
    since  REAL NOT NULL
);
"""

#: what a finished row holds (its request's payload is dropped when it finishes)
_HELD = "COALESCE(LENGTH(result), 0) + COALESCE(LENGTH(error), 0) + LENGTH(payload)"
#: answers kept for the apps: this many times the bounds on requests waiting, so that a
#: whole store's worth answered at once (a backlog expiring together) is kept entire:
#: at one bound, the newest of them were forgotten at once, their receipts a 404
_KEEP_FACTOR = 2
#: trimmed to this share of a bound, so the sort runs once per tenth of it, not per answer
_TRIM_TO = 0.9


_FINISHED = "('delivered', 'failed', 'expired')"


def db_error() -> type[Exception]:
    """``sqlite3.Error`` for an ``except`` clause: imported only when an exception is
    being matched (an agent that never defers never imports sqlite3)."""
    import sqlite3

    return sqlite3.Error


class StoreFailed(Overloaded):
    """The store's own fault (a full or read-only disk), not its bounds: still an
    ``overloaded`` answer for the app (retry later), but one the operator must hear of."""


@dataclass
class DeferredItem:
    request_id: str
    model: str
    payload: bytes
    created_wall: float
    expires_wall: float | None
    priority: int
    attempts: int
    app_id: str | None = None  # the id the app gave (its answer carries it back)


@dataclass
class DeferredResult:
    status: str
    result: bytes | None
    error: str | None
    model: str = ""
    owner: str = ""  # who deferred it ("" : any app; see Deferrer.result)


class DeferredStore:
    def __init__(self, path: Path, *, max_rows: int = 10_000, max_bytes: int = 256 << 20) -> None:
        """``max_rows`` / ``max_bytes`` bound the requests waiting (pending or sending):
        a deferral past them is refused with "overloaded", never dropped silently.
        Twice them bound the answers kept for the apps, apart: past that the oldest
        answers are forgotten first (an app that never fetches must not fill the disk
        for ``keep_results_s``), and a whole store's worth answered at once (a backlog
        expiring together) is always kept.  An answered row keeps its answer, not its
        request."""
        self.path = Path(path)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._conn: Any = None
        self._held_rows = self._held_bytes = 0  # finished rows kept for the apps
        if self.path.exists():
            self._open_left()

    def _open_left(self) -> None:
        """Open the store an earlier run left.  One that cannot be opened (permissions)
        stops the agent with a clear error; one that is not a database any more
        (corrupt, overwritten) is moved aside whole and the agent starts on a new one:
        the device keeps answering, and its rows stay on disk for whoever inspects them.
        Either had crashed the agent at start with a raw sqlite traceback."""
        import sqlite3

        try:
            self._open()
        except sqlite3.OperationalError as exc:  # (unable to open, read-only, locked)
            raise ConfigError(
                f"key 'state_dir': cannot open the deferred store {self.path}: {exc}"
            ) from None
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                for suffix in ("", "-wal", "-shm"):
                    part = Path(f"{self.path}{suffix}")
                    if part.exists():
                        part.rename(Path(f"{aside}{suffix}"))
            except OSError as move:
                raise ConfigError(
                    f"key 'state_dir': the deferred store {self.path} is unreadable ({exc}) "
                    f"and cannot be moved aside: {move}"
                ) from None
            log.error(
                "the deferred store %s is unreadable (%s): moved aside to %s; starting on "
                "a new one (the requests deferred in it will not be sent)",
                self.path,
                exc,
                aside,
            )

    def _open(self) -> Any:
        import sqlite3

        db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            self._prepare(db)
            self._conn = db
            self._count_held()
        except BaseException:
            self._conn = None
            db.close()
            raise
        return db

    def _prepare(self, db: Any) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(deferred)")}
        if "answered_wall" not in columns:  # a store an earlier version wrote
            db.execute("ALTER TABLE deferred ADD COLUMN answered_wall REAL")
        if "owner" not in columns:  # (its rows: anyone's, as they were)
            db.execute("ALTER TABLE deferred ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        if "app_id" not in columns:  # (its rows' answers keep the receipt's id)
            db.execute("ALTER TABLE deferred ADD COLUMN app_id TEXT")
        # a crash while sending counts as an attempt: a request that crashes the agent
        # every time must not loop forever
        db.execute(
            "UPDATE deferred SET status = 'pending', attempts = attempts + 1 WHERE status = 'sending'"
        )

    def _count_held(self) -> None:
        """The finished rows and their bytes, counted whole (then kept up as they change)."""
        self._held_rows, self._held_bytes = self._conn.execute(
            f"SELECT COUNT(*), COALESCE(SUM({_HELD}), 0) FROM deferred WHERE status IN {_FINISHED}"
        ).fetchone()

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
        owner: str = "",
        app_id: str | None = None,
    ) -> None:
        import sqlite3

        if self.max_bytes and len(payload) > self.max_bytes:  # no wait would make it fit
            raise PayloadTooLarge(
                f"the request is {len(payload)} bytes stored; the deferred store holds at "
                f"most {self.max_bytes} bytes ([store] max_bytes)"
            )
        try:  # disk full, read-only, corrupt: a typed refusal, not a raw sqlite error
            live = self._db.execute(
                "SELECT 1 FROM deferred WHERE request_id = ? AND status NOT IN "
                "('failed', 'expired')",
                (request_id,),
            ).fetchone()
            if live is not None:
                # An app's retry of a request still stored or answered: it is that one
                # (the same receipt), whatever room is left (a full store refused it).
                return
            rows, size = self._waiting()
            if self._full(rows, size, len(payload)) and self.expire(created_wall):
                rows, size = self._waiting()  # the dead made room
            if self._full(rows, size, len(payload)):
                raise Overloaded(
                    f"the deferred store is full ({rows} requests, {size} bytes waiting; "
                    f"bounds {self.max_rows} requests, {self.max_bytes} bytes)",
                    retry_after=60.0,
                )
            old = self._db.execute(
                f"SELECT {_HELD} FROM deferred WHERE request_id = ? AND status IN {_FINISHED}",
                (request_id,),
            ).fetchone()
            # The same id again (an app's retry, named after its idempotency key): a
            # request still stored or answered is that one; one that expired or failed
            # is stored afresh (its receipt would otherwise name a dead request).
            self._db.execute(
                "INSERT INTO deferred (request_id, model, payload, created_wall, expires_wall,"
                " priority, owner, app_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO"
                " UPDATE SET status = 'pending', model = excluded.model,"
                " payload = excluded.payload, created_wall = excluded.created_wall,"
                " expires_wall = excluded.expires_wall, priority = excluded.priority,"
                " owner = excluded.owner, app_id = excluded.app_id, attempts = 0,"
                " result = NULL, error = NULL,"
                " answered_wall = NULL WHERE status IN ('failed', 'expired')",
                (request_id, model, payload, created_wall, expires_wall, priority, owner, app_id),
            )
            if old is not None:
                self._count_held()
        except sqlite3.Error as exc:
            raise StoreFailed(
                f"the deferred store cannot take the request: {exc}", retry_after=60.0
            ) from None

    def _waiting(self) -> tuple[int, int]:
        """(requests, their bytes) waiting to be sent: what the bounds hold."""
        rows, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM deferred"
            " WHERE status IN ('pending', 'sending')"
        ).fetchone()
        return int(rows), int(size)

    def _full(self, rows: int, size: int, adding: int) -> bool:
        return bool(
            (self.max_rows and rows >= self.max_rows)
            or (self.max_bytes and size + adding > self.max_bytes)
        )

    def pending(
        self,
        limit: int = 100,
        now_wall: float | None = None,
        skip: frozenset[str] = frozenset(),
        skip_ids: frozenset[str] = frozenset(),
    ) -> list[DeferredItem]:
        """The most urgent pending requests, but for those of the models in ``skip`` (ones
        no transport takes now: the rest must not wait behind them) and the ids in
        ``skip_ids`` (tried already in this flush)."""
        if not self.opened:
            return []
        models, ids = sorted(skip), sorted(skip_ids)
        rows = self._db.execute(
            "SELECT request_id, model, payload, created_wall, expires_wall, priority, attempts,"
            " app_id FROM deferred"
            " WHERE status = 'pending' AND (expires_wall IS NULL OR ? IS NULL OR expires_wall > ?)"
            f" AND model NOT IN ({', '.join('?' * len(models))})"
            f" AND request_id NOT IN ({', '.join('?' * len(ids))})"
            f" ORDER BY {_URGENCY}, created_wall LIMIT ?",
            (now_wall, now_wall, *models, *ids, limit),
        ).fetchall()
        return [DeferredItem(r[0], r[1], bytes(r[2]), r[3], r[4], r[5], r[6], r[7]) for r in rows]

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

    def mark_delivered(
        self,
        request_id: str,
        result: bytes | None,
        error: str | None,
        now_wall: float | None = None,
    ) -> None:
        status = "delivered" if error is None else "failed"
        changed = self._db.execute(
            "UPDATE deferred SET status = ?, result = ?, error = ?, payload = x'',"
            f" answered_wall = ? WHERE request_id = ? AND status NOT IN {_FINISHED}",
            (status, result, error, time.time() if now_wall is None else now_wall, request_id),
        ).rowcount
        if changed:
            self._held_rows += 1
            self._held_bytes += len(result or b"") + len(error or "")  # (SQL LENGTH: chars)
            self._trim_answers(request_id)

    def _trim_answers(self, keep: str | None = None) -> int:
        """Forget the answers, failures and expiries answered longest ago once past the
        bounds, down to ``_TRIM_TO`` of them (``keep``: the one just written stays)."""
        max_rows, max_bytes = self.max_rows * _KEEP_FACTOR, self.max_bytes * _KEEP_FACTOR
        over_rows = max_rows and self._held_rows > max_rows
        over_bytes = max_bytes and self._held_bytes > max_bytes
        if not (over_rows or over_bytes):
            return 0
        rows = int(max_rows * _TRIM_TO) if max_rows else -1
        size = int(max_bytes * _TRIM_TO) if max_bytes else -1
        forgotten = self._db.execute(
            "DELETE FROM deferred WHERE request_id IN (SELECT request_id FROM (SELECT"
            f" request_id, ROW_NUMBER() OVER newest AS n, SUM({_HELD}) OVER newest AS held"
            f" FROM deferred WHERE status IN {_FINISHED} AND request_id IS NOT ?"
            " WINDOW newest AS (ORDER BY COALESCE(answered_wall, created_wall) DESC,"
            " request_id)) WHERE (? >= 0 AND n > ?) OR (? >= 0 AND held > ?))",
            (keep, rows, rows - (1 if keep else 0), size, size),
        ).rowcount
        self._count_held()
        return forgotten

    def result(self, request_id: str) -> DeferredResult | None:
        if not self.opened:
            return None
        row = self._db.execute(
            "SELECT status, result, error, model, owner FROM deferred WHERE request_id = ?",
            (request_id,),
        ).fetchone()
        if row is None:
            return None
        result = bytes(row[1]) if row[1] is not None else None
        return DeferredResult(row[0], result, row[2], row[3], row[4])

    def expire(self, now_wall: float) -> list[str]:
        if not self.opened:
            return []
        rows = self._db.execute(
            "SELECT request_id FROM deferred WHERE status = 'pending' AND expires_wall IS NOT NULL"
            " AND expires_wall <= ?",
            (now_wall,),
        ).fetchall()
        ids = [r[0] for r in rows]
        if ids:  # one statement, one commit (a row each was an fsync each)
            self._db.execute(
                "UPDATE deferred SET status = 'expired', error = 'deadline_exceeded: no link before the"
                " deferral expired', payload = x'', answered_wall = ? WHERE status = 'pending'"
                " AND expires_wall IS NOT NULL AND expires_wall <= ?",
                (now_wall, now_wall),
            )
        if ids:
            self._count_held()
            self._trim_answers()
        return ids

    def clock_mark(self) -> tuple[str | None, float, float] | None:
        """The wall clock the stamps are in, as the last process left it (None: unknown)."""
        row = self._db.execute("SELECT boot, offset, since FROM clock WHERE id = 0").fetchone()
        return None if row is None else (row[0], float(row[1]), float(row[2]))

    def set_clock_mark(self, mark: tuple[str | None, float, float]) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO clock (id, boot, offset, since) VALUES (0, ?, ?, ?)", mark
        )

    def shift(
        self, delta_s: float, since_wall: float, mark: tuple[str | None, float, float] | None = None
    ) -> int:
        """Move the stamps taken at or after ``since_wall`` by ``delta_s``: the wall
        clock was stepped (see :mod:`shared.wallclock`) and they are in its old time.
        With ``mark``, the clock they are in now is written in the same transaction: a
        crash between the two would have moved them again at the next start."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            moved = self._shift(db, delta_s, since_wall)
            if mark is not None:
                self.set_clock_mark(mark)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return moved

    def _shift(self, db: Any, delta_s: float, since_wall: float) -> int:
        cur = db.execute(
            "UPDATE deferred SET"
            " expires_wall = CASE WHEN created_wall >= :since THEN expires_wall + :delta"
            " ELSE expires_wall END,"
            " created_wall = CASE WHEN created_wall >= :since THEN created_wall + :delta"
            " ELSE created_wall END,"
            " answered_wall = CASE WHEN answered_wall >= :since THEN answered_wall + :delta"
            " ELSE answered_wall END"
            " WHERE created_wall >= :since OR answered_wall >= :since",
            {"delta": delta_s, "since": since_wall},  # (named: 3.12.1 warned of ?1)
        )
        return cur.rowcount

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
        if cur.rowcount:
            self._count_held()
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
