"""Status and placement documents on the broker, as both tiers read them (no I/O).

Nodes and the controller publish JSON; readers take MessagePack too, so a
publisher may switch to it without its readers changing.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from shared.errors import ConfigError


def decode_document(payload: bytes) -> Any:
    """A status or placement payload: JSON, or MessagePack (first byte a map marker)."""
    if not payload:
        return None
    try:
        if payload[:1] in (b"{", b"[", b" ", b"\n"):
            return json.loads(payload)
        return msgspec.msgpack.decode(payload)
    except (ValueError, msgspec.DecodeError) as exc:
        raise ConfigError(f"undecodable document: {exc}") from None
