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
    section: str | None = None,
) -> ssl.SSLContext:
    """Verify the server against ``ca_file`` (or the system CAs); present a client
    certificate for mutual TLS when given.  ``insecure`` skips verification (tests only).
    A file that is not what its key says is named with that key (``section.key``):
    OpenSSL's own words ("PEM lib") name neither."""

    def key(name: str) -> str:
        return f"{section}.{name}" if section else name

    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        what = f"key {key('ca_file')!r} ({ca_file})" if ca_file else "the system's CA store"
        raise ConfigError(
            f"TLS setup failed: {what} holds no usable CA certificate: {exc}"
        ) from None
    if cert_file:
        try:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        except (OSError, ssl.SSLError) as exc:
            pair = f"key {key('cert_file')!r} ({cert_file})"
            pair += (
                f" with {key('key_file')!r} ({key_file})"
                if key_file
                else f" (no {key('key_file')!r}: the file must hold the private key too)"
            )
            raise ConfigError(
                f"TLS setup failed: {pair} is not a client certificate and its private key: {exc}"
            ) from None
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
