"""What the node as a whole is running (the batchers' shared view).

:class:`NodeActivity` counts the batches running on the node, over all its
models: a lone request may take a session with a thread per core only when
nothing else runs (it would otherwise oversubscribe the cores).  The threads
the batches run on are :class:`shared.aio.threads.SessionThread`.
"""

from __future__ import annotations


class NodeActivity:
    """Batches running on this node, all models together (touched on the loop only)."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running = 0
