"""Transport-neutral inference requests and responses.

Both codecs (V2 HTTP and the MQTT envelope) decode into these types and
encode from them, so a dataplane never knows which front a request used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidInput
from shared.tensors import Tensor


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for; ``binary`` None means "front's default"."""

    name: str
    binary: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def unique_outputs(outputs: list[RequestedOutput]) -> list[RequestedOutput]:
    """The same ask twice is one ask (Triton keeps a set of requested outputs); two
    different forms of one output cannot both be answered under its one name."""
    asked: dict[str, RequestedOutput] = {}
    for out in outputs:
        before = asked.setdefault(out.name, out)
        if before is not out and (before.binary, before.parameters) != (
            out.binary,
            out.parameters,
        ):
            raise InvalidInput(f"output {out.name!r} is requested twice with different parameters")
    return list(asked.values()) if len(asked) < len(outputs) else outputs


@dataclass(slots=True)
class InferRequest:
    inputs: list[Tensor]
    id: str | None = None
    model_version: str | None = None
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def input_dict(self) -> dict[str, Any]:
        return {t.name: t.data for t in self.inputs}

    def output_names(self) -> list[str] | None:
        return None if self.outputs is None else [o.name for o in self.outputs]


@dataclass(slots=True)
class InferResponse:
    model_name: str
    outputs: list[Tensor]
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def output(self, name: str) -> Tensor:
        for tensor in self.outputs:
            if tensor.name == name:
                return tensor
        raise KeyError(name)
