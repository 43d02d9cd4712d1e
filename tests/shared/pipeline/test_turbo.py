"""The libturbojpeg binding: the library's own pixels, one decompressor per thread."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from shared.pipeline import images, turbo
from tests.shared.pipeline.conftest import encode, photo

TJ = turbo.load()
pytestmark = pytest.mark.skipif(TJ is None, reason="libturbojpeg0 is not installed")


def test_the_header_gives_the_declared_size_without_decoding() -> None:
    header = TJ.header(encode(photo(80, 120), "JPEG"))
    assert (header.width, header.height) == (120, 80)


@pytest.mark.parametrize("color", ["rgb", "bgr", "gray"])
def test_a_full_size_decode_matches_pillows_libjpeg(color: str) -> None:
    data = encode(photo(64, 96), "JPEG")
    out = TJ.decode(data, TJ.header(data), 1, color)
    with Image.open(io.BytesIO(data)) as im:
        ref = np.asarray(im.convert("L" if color == "gray" else "RGB"))
    ref = ref[:, :, None] if color == "gray" else ref[:, :, ::-1] if color == "bgr" else ref
    assert out.shape == ref.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 2


@pytest.mark.parametrize(
    ("need", "denominator", "shape"),
    [
        ((100, 75), 8, (75, 100)),
        ((101, 75), 4, (150, 200)),
        ((401, 300), 1, (600, 800)),
        ((799, 599), 1, (600, 800)),
    ],
)
def test_the_decode_is_scaled_by_the_largest_reduction_that_covers_the_need(
    need: tuple[int, int], denominator: int, shape: tuple[int, int]
) -> None:
    data = encode(photo(600, 800), "JPEG")
    header = TJ.header(data)
    assert images._reduction((header.width, header.height), need) == denominator
    assert TJ.decode(data, header, denominator, "rgb").shape == (*shape, 3)


def test_a_thread_keeps_one_decompressor_and_threads_do_not_share_it() -> None:
    data = encode(photo(64, 64), "JPEG")
    TJ.header(data)
    mine = TJ._own()
    TJ.decode(data, TJ.header(data), 1, "rgb")
    assert TJ._own() is mine
    theirs: list[object] = []
    worker = threading.Thread(target=lambda: theirs.append(TJ._own()))
    worker.start()
    worker.join()
    assert theirs[0] is not mine


def test_bytes_that_are_not_a_jpeg_raise_the_librarys_message() -> None:
    with pytest.raises(turbo.TurboJpegError, match="Not a JPEG"):
        TJ.header(b"plain text, not an image")


def test_a_jpeg_without_a_frame_reads_as_no_pixels_which_decode_refuses() -> None:
    from shared.errors import InvalidInput
    from tests.shared.pipeline.test_images import target

    data = b"\xff\xd8\xff" + b"\x00" * 64
    assert TJ.header(data) == turbo.Header(0, 0)
    with pytest.raises(InvalidInput, match="declares no size"):
        images.decode(data, target())


def test_a_truncated_body_fails_the_decode_instead_of_returning_grey() -> None:
    data = encode(photo(256, 256), "JPEG")
    cut = data[: len(data) // 2]
    with pytest.raises(turbo.TurboJpegError):
        TJ.decode(cut, TJ.header(cut), 1, "rgb")


def test_an_image_that_fails_leaves_nothing_behind_for_the_next_one_on_its_thread() -> None:
    from tests.shared.pipeline.test_images import target

    good = encode(photo(300, 400), "JPEG")
    want = images.decode(good, target())
    failures = 0
    for cut in range(20, len(good), max(1, len(good) // 60)):
        try:
            images.decode(good[:cut], target())
        except Exception:
            failures += 1
        # the good image decodes as before, on the thread that just failed
        np.testing.assert_array_equal(images.decode(good, target()), want)
    assert failures > 10
