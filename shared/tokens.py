"""Bearer tokens with scopes, for the HTTP fronts of both tiers.

A tokens file holds one token per line, optionally followed by its scope::

    s3cret-admin            # no scope: everything (the format of earlier releases)
    ops-token admin         # the control plane: repository load/unload/index, metrics
    app-token infer         # inference and model metadata, every model
    cam-token infer cam,ocr # inference on these models only

The token values are secrets: they never appear in a repr, a log line or an
error message; comparisons take the same time whichever token matches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

SCOPES = ("infer", "admin")


@dataclass(frozen=True)
class Grant:
    """What one token may do; ``models`` None means every model."""

    token: bytes = field(repr=False)
    scopes: frozenset[str]
    models: frozenset[str] | None = None

    @property
    def principal(self) -> str:
        """A stable name for the holder that reveals nothing of the token."""
        import hashlib  # only with tokens configured (it maps OpenSSL's libcrypto)

        return "tok-" + hashlib.sha256(self.token).hexdigest()[:16]

    def allows(self, scope: str, model: str | None) -> bool:
        if scope not in self.scopes:
            return False
        return model is None or self.models is None or model in self.models


@dataclass(frozen=True)
class Tokens:
    grants: tuple[Grant, ...] = field(repr=False)

    def __repr__(self) -> str:
        return f"Tokens({len(self.grants)} tokens)"

    def find(self, given: bytes) -> Grant | None:
        """The grant of ``given`` (every token compared, so timing reveals nothing)."""
        found = None
        for grant in self.grants:
            if _compare(given, grant.token):
                found = grant
        return found

    @property
    def has_admin(self) -> bool:
        return any("admin" in g.scopes for g in self.grants)


def _compare(a: bytes, b: bytes) -> bool:
    """Constant-time comparison; hmac (and OpenSSL's hashlib with it) is imported only
    where tokens are configured."""
    import hmac

    return hmac.compare_digest(a, b)


def parse_tokens(text: str, source: str) -> Tokens:
    grants = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.split(r"\s#", raw, maxsplit=1)[0].strip()  # drop comments
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        token, rest = parts[0], parts[1:]
        if not rest:
            grants.append(Grant(token.encode(), frozenset(SCOPES)))
            continue
        scope = rest[0]
        if scope not in SCOPES or len(rest) > 2 or (scope == "admin" and len(rest) > 1):
            raise ConfigError(
                f"{source}: line {number}: expected '<token> [infer [model,...] | admin]'"
            )
        models = None
        if len(rest) == 2:
            models = frozenset(m for m in rest[1].split(",") if m)
        grants.append(Grant(token.encode(), frozenset({scope}), models))
    if not grants:
        raise ConfigError(f"{source}: tokens file holds no token")
    return Tokens(tuple(grants))


def load_tokens(path: Path) -> Tokens:
    try:
        text = Path(path).read_text(encoding="utf-8")
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read tokens file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # (a ValueError: it had ended the file's follower)
        raise ConfigError(f"{path}: tokens file is not UTF-8 text: {exc.reason}") from None
    if mode & 0o004:  # (Mosquitto 2 says the same of a readable password file)
        logging.getLogger(__name__).warning(
            "%s: the tokens file is readable by every user of this machine; chmod o-r (or 600) it",
            path,
        )
    return parse_tokens(text, str(path))


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class TokensFile:
    """A tokens file followed while the process runs: revoking a leaked token must
    not wait for a restart (both tiers had read the file once, at start, and went on
    accepting a token removed from it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp = _stamp(self.path)
        self.tokens = load_tokens(self.path)

    def refresh(self) -> Tokens | None:
        """The new tokens if the file changed since the last look, else None.  A file
        that cannot be read or parsed keeps the tokens in use (logged once per change):
        a half-written or deleted file must not lock every client out, nor open the
        API.  Blocking (a stat, and a read on a change): call it off the event loop."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        log = logging.getLogger(__name__)
        try:
            tokens = load_tokens(self.path)
        except ConfigError as exc:
            log.error("%s; keeping the %d tokens in use", exc.message, len(self.tokens.grants))
            return None
        self.tokens = tokens
        log.info("%s: tokens file changed: %d tokens in use", self.path, len(tokens.grants))
        return tokens


async def follow_tokens(
    file: TokensFile, apply: Callable[[Tokens], None], every_s: float = 1.0
) -> None:
    """Look at ``file`` every ``every_s`` seconds and ``apply`` its tokens when they
    change (until cancelled)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            tokens = await asyncio.to_thread(file.refresh)
        except Exception:  # whatever it was, the next change must still be followed
            logging.getLogger(__name__).exception(
                "%s: tokens file not read; keeping the tokens in use", file.path
            )
            continue
        if tokens is not None:
            apply(tokens)


def granted_stats(doc: dict[str, Any], grant: Grant | None) -> dict[str, Any]:
    """A statistics answer cut to the models ``grant`` covers (the all-models one had
    shown a token limited to one model every model's traffic)."""
    if grant is None or grant.models is None:
        return doc
    kept = [e for e in doc.get("model_stats", []) if grant.allows("infer", e.get("name"))]
    return {**doc, "model_stats": kept}


def is_loopback(address: str | None) -> bool:
    """Whether a peer address is this machine (the control plane's default audience)."""
    if not address:
        return False
    try:
        import ipaddress

        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bearer(header: str) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (None if not bearer)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    # Header bytes that are not UTF-8 arrive as surrogate escapes: a wrong token like
    # any other, never an encoding error.
    return token.strip().encode("utf-8", "surrogateescape")
