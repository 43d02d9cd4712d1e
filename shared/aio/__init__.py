"""The I/O shells both tiers share: the MQTT v5 client and the HTTP/1.1 server and client.

Everything else in ``shared/`` is sans-IO (DESIGN.md section 1); these are
the thin asyncio layers over its codecs (:mod:`shared.mqtt`,
:mod:`shared.http`), kept here once rather than copied into each tier.  They
open sockets only when asked to, and import nothing from either tier.
"""
