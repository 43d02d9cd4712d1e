"""Codec cost beside a plain copy of the same payload, measured in one run.

    python bench/codec.py [--repeat N]

For a 1x3x224x224 FP32 request (602 KB) and a 1,000-element FP32 reply, times
encode + decode for V2 JSON, V2 binary and the MQTT MessagePack envelope, and
a ``bytes(memoryview)`` copy of the same tensor bytes.  Binary encode includes
joining the buffers into one body, so the figure is what a transport that
needs contiguous bytes would pay.  Target: binary and MessagePack within 3x
of the copy for the 602 KB tensor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from shared import envelope, v2
from shared.messages import InferRequest, InferResponse
from shared.tensors import Tensor


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _cases(array: np.ndarray, as_request: bool) -> dict[str, Callable[[], object]]:
    tensor = Tensor.from_array("x" if as_request else "probs", array)
    if as_request:
        message = InferRequest(inputs=[tensor], id="1")

        def v2_binary() -> object:
            chunks, hl = v2.encode_request(message)
            return v2.decode_request(v2.join(chunks), hl)

        def v2_json() -> object:
            chunks, hl = v2.encode_request(message, binary_inputs=False)
            return v2.decode_request(v2.join(chunks), hl)

        def msgpack() -> object:
            return envelope.decode_request(envelope.encode_request(message))

    else:
        response = InferResponse("m", [tensor], "1", "1", {"queue_us": 1, "compute_us": 2})
        binary_req = InferRequest(inputs=[], parameters={"binary_data_output": True})

        def v2_binary() -> object:
            chunks, hl = v2.encode_response(response, binary_req)
            return v2.decode_response(v2.join(chunks), hl)

        def v2_json() -> object:
            chunks, hl = v2.encode_response(response, None)
            return v2.decode_response(v2.join(chunks), hl)

        def msgpack() -> object:
            return envelope.decode_reply(envelope.encode_reply(response))

    view = memoryview(array).cast("B")
    return {
        "bytes(memoryview) copy": lambda: bytes(view),
        "V2 binary": v2_binary,
        "MessagePack envelope": msgpack,
        "V2 JSON": v2_json,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    payloads = {
        "request 1x3x224x224 FP32 (602 KB)": (rng.random((1, 3, 224, 224), dtype=np.float32), True),
        "reply 1x1000 FP32 (4 KB)": (rng.random((1, 1000), dtype=np.float32), False),
    }
    ok = True
    for title, (array, as_request) in payloads.items():
        cases = _cases(array, as_request)
        repeat = args.repeat if as_request else args.repeat * 10
        results = {
            name: _median_us(fn, repeat // 10 if name == "V2 JSON" else repeat)
            for name, fn in cases.items()
        }
        base = results["bytes(memoryview) copy"]
        print(f"\n{title}: encode + decode, median of runs")
        print(f"  {'path':<24} {'us':>10} {'x copy':>8}")
        for name, us in results.items():
            print(f"  {name:<24} {us:>10.1f} {us / base:>8.2f}")
        if as_request:
            for name in ("V2 binary", "MessagePack envelope"):
                ratio = results[name] / base
                verdict = "meets" if ratio <= 3.0 else "MISSES"
                ok &= ratio <= 3.0
                print(f"  target {name} <= 3x copy: {ratio:.2f}x ({verdict})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
