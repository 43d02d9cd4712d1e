"""Decoding: every format, every decoder, and every bad image refused with a clear 400."""

from __future__ import annotations

import resource
from dataclasses import replace

import numpy as np
import pytest

from shared.errors import InvalidInput
from shared.pipeline import images
from shared.pipeline.spec import IMAGE_FORMATS
from tests.shared.pipeline.conftest import encode, jpeg_declaring, photo, png_declaring


def target(**kw: object) -> images.Target:
    base = dict(
        height=64,
        width=64,
        color="rgb",
        resize="stretch",
        shorter_side=None,
        interpolation="bilinear",
        formats=IMAGE_FORMATS,
        max_pixels=40_000_000,
        decoder="auto",
        where="input 'image'",
    )
    base.update(kw)
    return images.Target(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP"])
@pytest.mark.parametrize("decoder", ["auto", *images.available_decoders()])
def test_every_format_decodes_to_the_target_size_with_every_decoder(fmt: str, decoder: str) -> None:
    data = encode(photo(), fmt)
    out = images.decode(data, target(decoder=decoder))
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    reference = images.decode(data, target(decoder="pillow"))
    # decoders differ by IDCT rounding and resampling, not by content
    assert np.abs(out.astype(int) - reference.astype(int)).mean() < 6


def test_colour_orders_are_channel_reversals_and_gray_has_one_channel() -> None:
    data = encode(photo(64, 64), "PNG")
    rgb = images.decode(data, target())
    bgr = images.decode(data, target(color="bgr"))
    gray = images.decode(data, target(color="gray"))
    assert np.array_equal(rgb[:, :, ::-1], bgr)
    assert gray.shape == (64, 64, 1)


def test_shorter_side_resize_then_centre_crop_keeps_the_aspect_ratio() -> None:
    pixels = np.zeros((100, 200, 3), np.uint8)
    pixels[:, 50:150] = 255  # the middle half is white
    out = images.decode(
        encode(pixels, "PNG"),
        target(resize="shorter_side", shorter_side=64, interpolation="nearest"),
    )
    # 100x200 -> 64x128, centre 64x64 crop covers columns 32..96 of 128: all white
    assert out.shape == (64, 64, 3) and out.min() == 255


def test_a_truncated_jpeg_is_refused_not_decoded_half_grey(photo_jpeg: bytes) -> None:
    with pytest.raises(InvalidInput, match="truncated"):
        images.decode(photo_jpeg[: len(photo_jpeg) * 2 // 3], target())


@pytest.mark.skipif(
    "turbojpeg" not in images.available_decoders(), reason="only libturbojpeg reports lost data"
)
@pytest.mark.parametrize("decoder", ["auto", "turbojpeg"])
def test_a_jpeg_cut_short_behind_an_end_marker_is_refused(photo_jpeg: bytes, decoder: str) -> None:
    """An end-of-image marker glued after lost data passed the truncation check, and the
    fallback decoders answered a 200 on a picture two-thirds grey."""
    bad = photo_jpeg[: len(photo_jpeg) // 3] + b"\xff\xd9"
    with pytest.raises(InvalidInput, match=r"input 'image': a corrupt JPEG image: .*missing"):
        images.decode(bad, target(decoder=decoder))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_a_truncated_png_or_webp_is_refused(fmt: str) -> None:
    data = encode(photo(), fmt)
    with pytest.raises(InvalidInput):
        images.decode(data[: len(data) // 2], target())


@pytest.mark.parametrize(
    "data", [b"", b"hello world", b"%PDF-1.7\n", b"\x00" * 1000, b"GIF89a" + b"\x00" * 20]
)
def test_bytes_that_are_not_an_accepted_image_are_refused_naming_the_input(data: bytes) -> None:
    with pytest.raises(InvalidInput, match="input 'image'"):
        images.decode(data, target())


def test_a_format_the_model_does_not_accept_is_refused() -> None:
    with pytest.raises(InvalidInput, match="PNG images are not accepted"):
        images.decode(encode(photo(), "PNG"), target(formats=("jpeg",)))


@pytest.mark.parametrize("make", [png_declaring, jpeg_declaring])
def test_a_declared_20000_by_20000_image_is_refused_before_any_pixel_is_allocated(make) -> None:
    data = make(20_000, 20_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidInput, match="20000x20000"):
        images.decode(data, target())
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100 * 1024  # 20000^2 RGB would be 1.1 GiB


def test_a_long_strip_is_resized_only_where_the_crop_reads(monkeypatch) -> None:
    # A 167-byte 30000x1 PNG resized whole to 256 high is 7.7 million pixels wide
    # (gigabytes, seconds): only the part the centre crop keeps is resized.
    sizes: list[tuple[int, int]] = []
    resize = images._resize

    def recorded(pixels, height, width, t):
        sizes.append((height, width))
        return resize(pixels, height, width, t)

    monkeypatch.setattr(images, "_resize", recorded)
    ways = [{}, {"interpolation": "area"}, {"decoder": "pillow"}]  # warped, or a box resized
    for shape in [(1, 30_000, 3), (30_000, 1, 3)]:
        data = encode(np.full(shape, 200, np.uint8), "PNG")
        for way in ways:
            out = images.decode(data, target(resize="shorter_side", shorter_side=72, **way))
            assert out.shape == (64, 64, 3) and int(out.min()) == int(out.max()) == 200
    assert all(h * w <= images.CROP_FIRST * 72 * 72 for h, w in sizes)


def test_a_strip_resized_where_the_crop_reads_matches_the_whole_resize(monkeypatch) -> None:
    y, x = np.mgrid[0:100, 0:1500]
    smooth = np.stack(
        [127 + 100 * np.sin(x / 37 + y / 23), 127 + 100 * np.cos(x / 53), 127 + 90 * np.sin(y / 9)],
        axis=-1,
    ).astype(np.uint8)
    data = encode(smooth, "PNG")
    t = target(resize="shorter_side", shorter_side=72)
    area = target(resize="shorter_side", shorter_side=72, interpolation="area")
    cut, cut_area = images.decode(data, t).astype(int), images.decode(data, area).astype(int)
    monkeypatch.setattr(images, "CROP_FIRST", 10**9)
    whole, whole_area = images.decode(data, t).astype(int), images.decode(data, area).astype(int)
    assert np.abs(cut - whole).max() <= 1  # warped: the same samples, fixed-point rounding
    assert np.abs(cut_area - whole_area).mean() < 3  # cut first: within a pixel at the cut


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_image_cut_inside_its_header_is_refused_as_unreadable(fmt: str) -> None:
    data = encode(photo(), fmt)[:10]
    with pytest.raises(InvalidInput, match="not a readable") as caught:
        images.decode(data, target())
    assert "max_pixels" not in str(caught.value)
    assert "BytesIO" not in str(caught.value) and " at 0x" not in str(caught.value)


def test_a_decompression_bomb_past_pillows_own_limit_is_refused_with_its_size() -> None:
    data = png_declaring(60_000, 60_000)  # 3.6 Gpx: Pillow itself raises DecompressionBombError
    with pytest.raises(InvalidInput, match="60000x60000"):
        images.decode(data, target())


def test_max_pixels_is_the_bound_and_names_its_key() -> None:
    data = encode(photo(100, 100), "PNG")
    images.decode(data, target(max_pixels=10_000))
    with pytest.raises(InvalidInput, match="max_pixels"):
        images.decode(data, target(max_pixels=9_999))


def test_a_corrupt_jpeg_body_is_refused_or_decoded_never_a_crash(photo_jpeg: bytes) -> None:
    data = bytearray(photo_jpeg)
    middle = len(data) // 2
    data[middle : middle + 200] = bytes(range(200))
    try:
        out = images.decode(bytes(data), target())
    except InvalidInput:
        return
    assert out.shape == (64, 64, 3)


def _exif_rotated(fmt: str) -> bytes:
    """An asymmetric picture carrying EXIF orientation 6 ("rotate 90 clockwise to view")."""
    import io

    from PIL import Image

    pixels = np.zeros((48, 64, 3), np.uint8)
    pixels[:, :16] = 255  # a white band on the left: turned, it would be on top
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(pixels).save(
        buf, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {})
    )
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("decoder", ["auto", *images.available_decoders()])
def test_every_decoder_leaves_exif_orientation_unapplied(fmt: str, decoder: str) -> None:
    # OpenCV turned such images and the others did not: a JPEG's answer depended on the
    # libraries each machine has (the docs say orientation is not applied)
    out = images.decode(_exif_rotated(fmt), target(decoder=decoder, height=48, width=64))
    assert out.shape == (48, 64, 3)
    assert out[:, :12].mean() > 200 and out[:, 24:].mean() < 50


@pytest.mark.parametrize("decoder", ["auto", *images.available_decoders()])
def test_a_16_bit_gray_png_keeps_its_levels_with_every_decoder(decoder: str) -> None:
    import io

    from PIL import Image

    ramp = (np.arange(64)[:, None] * 1024 * np.ones((1, 64))).astype(np.uint16)  # 0..64512
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    out = images.decode(buf.getvalue(), target(decoder=decoder, color="gray"))
    expected = (ramp >> 8).astype(int)
    # Pillow's convert("L") clipped every level past 255 (a near-white image)
    assert np.abs(out[:, :, 0].astype(int) - expected).mean() < 2


def test_decoded_pixels_of_concurrent_decodes_stay_within_the_process_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each image was bounded alone: many workers decoding big PNGs at once held
    # gigabytes together.  A decode now waits until its pixels fit the budget.
    from concurrent.futures import ThreadPoolExecutor

    png = encode(photo(600, 800), "PNG")  # 600 x 800 x 3 x 2 = 2.9 MB held per decode
    budget = images.PixelBudget(6_000_000)  # two at a time
    monkeypatch.setattr(images, "_budget", budget)
    with ThreadPoolExecutor(6) as pool:
        shapes = list(pool.map(lambda _: images.decode(png, target()).shape, range(12)))
    assert shapes == [(64, 64, 3)] * 12
    assert 0 < budget.peak <= budget.limit and budget.used == 0
    # one image bigger than the whole budget still decodes, alone
    monkeypatch.setattr(images, "_budget", images.PixelBudget(1000))
    assert images.decode(png, target()).shape == (64, 64, 3)
    assert images.pixel_budget().used == 0


def test_a_decode_that_fails_gives_its_pixels_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.errors import InvalidInput

    budget = images.PixelBudget(10_000_000)
    monkeypatch.setattr(images, "_budget", budget)
    good = encode(photo(300, 400), "PNG")
    with pytest.raises(InvalidInput):
        images.decode(good[: len(good) // 2], target())
    assert budget.used == 0


def test_the_pixel_budget_admits_in_arrival_order_so_a_big_decode_is_not_starved() -> None:
    import threading
    import time

    budget = images.PixelBudget(100)
    order: list[str] = []
    small = budget.held(40)
    small.__enter__()  # 40 held

    def take(name: str, nbytes: int) -> None:
        with budget.held(nbytes):
            order.append(name)
            time.sleep(0.05)

    big = threading.Thread(target=take, args=("big", 90))  # waits: 40 + 90 > 100
    big.start()
    time.sleep(0.05)
    late = threading.Thread(target=take, args=("late", 30))  # would fit now, but after big
    late.start()
    time.sleep(0.05)
    assert order == []
    small.__exit__(None, None, None)
    big.join()
    late.join()
    assert order == ["big", "late"] and budget.used == 0


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "BMP"])
@pytest.mark.parametrize("decoder", ["auto", *images.available_decoders()])
def test_a_lossless_colour_image_turns_to_the_same_grey_bytes_with_every_decoder(
    fmt: str, decoder: str
) -> None:
    # OpenCV's grey PNG (libpng's) truncated where Pillow rounds: one machine's tensor
    # was 1 below another's for the same image, by the decoders each had
    rng = np.random.default_rng(3)
    colours = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = encode(colours, fmt, lossless=True) if fmt == "WEBP" else encode(colours, fmt)
    out = images.decode(data, target(decoder=decoder, color="gray", interpolation="nearest"))
    want = images.decode(data, target(decoder="pillow", color="gray", interpolation="nearest"))
    assert np.array_equal(out, want)


def test_scaled_decode_off_gives_a_jpeg_the_tensor_of_its_full_decode() -> None:
    """The scaled IDCT smooths like an anti-aliasing filter: the same pixels sent as a
    JPEG and as a PNG gave tensors far apart, with no way to match a full-decode
    training pipeline."""
    import io

    from PIL import Image

    rng = np.random.default_rng(3)
    pixels = np.where(rng.random((1200, 1600, 1)) < 0.5, 0, 255).astype(np.uint8)
    pixels = np.repeat(np.kron(pixels[:150, :200], np.ones((8, 8, 1), np.uint8)), 3, axis=2)
    jpeg = encode(pixels, "JPEG", quality=95)
    full = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    png = encode(full, "PNG")
    small = target(height=150, width=200, decoder="pillow")
    exact = images.decode(png, small).astype(int)
    off = images.decode(jpeg, replace(small, scaled_decode=False)).astype(int)
    on = images.decode(jpeg, small).astype(int)
    assert np.abs(off - exact).max() <= 2
    assert np.abs(on - exact).max() > np.abs(off - exact).max()


@pytest.mark.parametrize("decoder", ["auto", *images.available_decoders()])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_the_picture_as_a_phone_shows_it(
    decoder: str, orientation: int
) -> None:
    """Off by default (as DALI); on, every decoder turns the pixels as Pillow's
    ImageOps.exif_transpose does, before the resize."""
    import io

    from PIL import Image, ImageOps

    exif = Image.Exif()
    exif[0x0112] = orientation
    jpeg = encode(photo(120, 200), "JPEG", quality=95, exif=exif.tobytes())
    shown = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg))).convert("RGB"))
    plain = target(height=48, width=80, decoder=decoder, scaled_decode=False)
    want = images.decode(encode(shown, "PNG"), plain).astype(int)
    turned = images.decode(jpeg, replace(plain, exif_orientation=True)).astype(int)
    assert np.abs(turned - want).mean() < 2
    if orientation != 1:  # (and off, the stored pixels as they are)
        assert np.abs(images.decode(jpeg, plain).astype(int) - want).mean() > 5
