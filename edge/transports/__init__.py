"""Ways to reach the cloud tier, behind one interface (:class:`Transport`)."""

from edge.transports.base import TransferResult, Transport

__all__ = ["TransferResult", "Transport"]
