"""BYTES tensors on the wire: 4-byte little-endian length + data, element after element.

The format is a chain (where element i+1 starts depends on element i's
length), so it cannot be parsed in one vectorised step.  What real traffic
sends is runs of equal lengths (fixed-width ids, empty strings, same-size
images), and an attacker's cheapest body is millions of tiny elements:
both are runs.  So the parser walks the chain, and wherever two elements in
a row have the same length it checks the rest of the run with numpy in one
pass and cuts it out at C speed.  Mixed lengths fall back to one Python step
per element.

Long numpy calls hold the GIL; these parsers run in worker threads while the
event loop waits, so every vectorised step covers at most :data:`CHUNK`
elements (a few milliseconds), and the loop gets the GIL between steps.
"""

from __future__ import annotations

import struct
from itertools import chain

import numpy as np

from shared.errors import InvalidInput

_U32 = struct.Struct("<I")
#: elements per vectorised step (bounds how long one step holds the GIL)
CHUNK = 1 << 17


def _run_length(view: np.ndarray, start: int, length: int, most: int) -> int:
    """How many elements from ``start`` (at most ``most``) all declare ``length``."""
    stride = 4 + length
    total = len(view)
    found = 0
    window = 16  # grows while the run holds, so a short run costs a short check
    while found < most:
        step = min(window, most - found)
        window = min(window * 4, CHUNK)
        first = start + found * stride
        step = min(step, (total - first) // stride)  # whole elements only
        if step <= 0:
            break
        # the prefixes of ``step`` elements as a strided uint8 view -> uint32
        heads = np.lib.stride_tricks.as_strided(
            view[first:], shape=(step, 4), strides=(stride, 1), writeable=False
        )
        lens = heads.copy().view("<u4").reshape(step)
        bad = np.flatnonzero(lens != length)
        if len(bad):
            return found + int(bad[0])
        found += step
    return found


def _cut_run(data: bytes, items: list[bytes], start: int, length: int, n: int) -> None:
    """Append ``n`` elements of ``length`` bytes, the first one's prefix at ``start``."""
    if length == 0:
        items.extend([b""] * n)
        return
    stride = 4 + length
    dtype = np.dtype([("n", "<u4"), ("d", f"V{length}")])
    for done in range(0, n, CHUNK):
        step = min(CHUNK, n - done)
        records = np.frombuffer(data, dtype=dtype, count=step, offset=start + done * stride)
        items.extend(records["d"].tolist())


#: up to this many elements, each is copied once out of the view (no whole-buffer copy)
_FEW = 16


def _decode_few(name: str, shape: tuple[int, ...], count: int, view: memoryview) -> np.ndarray:
    """A handful of (often large) elements: one copy each, straight from the view."""
    total = len(view)
    items: list[bytes] = []
    offset = 0
    for i in range(count):
        if offset + 4 > total:
            raise InvalidInput(f"input {name!r}: BYTES element {i} truncated (no length prefix)")
        (length,) = _U32.unpack_from(view, offset)
        end = offset + 4 + length
        if end > total:
            raise InvalidInput(
                f"input {name!r}: BYTES element {i} declares {length} bytes, "
                f"only {total - offset - 4} remain"
            )
        items.append(bytes(view[offset + 4 : end]))
        offset = end
    if offset != total:
        raise InvalidInput(
            f"input {name!r}: {total - offset} bytes left over after {count} BYTES elements"
        )
    out = np.empty(count, dtype=object)
    out[:] = items
    return out.reshape(shape)


def decode_bytes(
    name: str, shape: tuple[int, ...], count: int, buf: memoryview | bytes
) -> np.ndarray:
    """Parse ``count`` length-prefixed elements that must fill ``buf`` exactly."""
    total = len(buf)
    if count * 4 > total:
        raise InvalidInput(
            f"input {name!r}: {count} BYTES elements need at least {count * 4} bytes, got {total}"
        )
    if count <= _FEW and not isinstance(buf, bytes):
        return _decode_few(name, shape, count, memoryview(buf))
    data = buf if isinstance(buf, bytes) else bytes(buf)
    view = np.frombuffer(data, dtype=np.uint8)
    items: list[bytes] = []
    append = items.append
    unpack = _U32.unpack_from
    offset = 0
    i = 0
    previous = -1
    streak = 0  # elements in a row with the same length
    need = 3  # streak that makes a vectorised run worth trying; doubles after a miss
    while i < count:
        if offset + 4 > total:
            raise InvalidInput(f"input {name!r}: BYTES element {i} truncated (no length prefix)")
        (length,) = unpack(data, offset)
        streak = streak + 1 if length == previous else 0
        if streak >= need and count - i > 16:
            run = _run_length(view, offset, length, count - i)
            if run > 16:
                _cut_run(data, items, offset, length, run)
                i += run
                offset += run * (4 + length)
                previous, streak, need = -1, 0, 3
                continue
            need = min(need * 2, 1 << 12)
        end = offset + 4 + length
        if end > total:
            raise InvalidInput(
                f"input {name!r}: BYTES element {i} declares {length} bytes, "
                f"only {total - offset - 4} remain"
            )
        append(data[offset + 4 : end])
        offset = end
        previous = length
        i += 1
    if offset != total:
        raise InvalidInput(
            f"input {name!r}: {total - offset} bytes left over after {count} BYTES elements"
        )
    out = np.empty(count, dtype=object)
    for start in range(0, count, CHUNK):
        out[start : start + CHUNK] = items[start : start + CHUNK]
    return out.reshape(shape)


def encode_bytes(array: np.ndarray) -> bytes:
    """The wire form of a BYTES array, in C order (str elements as UTF-8)."""
    items = array.reshape(-1).tolist()
    if any(not isinstance(item, bytes) for item in items):
        items = [item.encode() if isinstance(item, str) else bytes(item) for item in items]
    if not items:
        return b""
    lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    first = int(lengths[0])
    if (lengths == first).all():
        body = np.frombuffer(b"".join(items), dtype=np.uint8).reshape(len(items), first)
        prefix = np.full((len(items), 1), first, dtype="<u4").view(np.uint8)
        return np.concatenate([prefix, body], axis=1).tobytes()
    return b"".join(chain.from_iterable(zip(map(_U32.pack, lengths.tolist()), items, strict=True)))
