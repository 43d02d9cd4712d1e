"""The client TLS context both tiers build for their broker and HTTP connections."""

from __future__ import annotations

import ssl
from pathlib import Path

from shared.errors import ConfigError


def client_tls_context(
    ca_file: str | Path | None = None,
    *,
    insecure: bool = False,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> ssl.SSLContext:
    """Verify the server against ``ca_file`` (or the system CAs); present a client
    certificate for mutual TLS when given.  ``insecure`` skips verification (tests only)."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        if cert_file:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS setup failed: {exc}") from None
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
