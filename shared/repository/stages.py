"""Parsing ``[[preprocess]]`` and ``[[postprocess]]`` tables of ``config.toml``.

Declarative on purpose: a model folder never brings code to run, only keys
checked here (errors name the file and the dotted key), so a repository can
be served from an untrusted source as safely as one without stages.
"""

from __future__ import annotations

import math

from shared.datatypes import DATATYPES
from shared.errors import ConfigError
from shared.pipeline.spec import (
    COLORS,
    DECODERS,
    DEFAULT_MAX_PIXELS,
    IMAGE_FORMATS,
    INTERPOLATIONS,
    LAYOUTS,
    RESIZE_MODES,
    ImageInput,
    OutputStage,
)
from shared.repository.checks import (
    check_bool,
    check_choice,
    check_int,
    check_name,
    check_number,
    check_table,
    fail,
)

_PRE = (
    "input",
    "tensor",
    "formats",
    "resize",
    "size",
    "shorter_side",
    "interpolation",
    "color",
    "scale",
    "mean",
    "std",
    "layout",
    "datatype",
    "max_pixels",
    "scaled_decode",
    "exif_orientation",
    "decoder",
)
_POST = ("output", "name", "softmax", "top_k", "argmax", "labels")
#: a side no image input may be resized to (bounds the tensor a request makes)
MAX_SIDE = 8192


def parse_preprocess(value: object, source: str) -> tuple[ImageInput, ...]:
    if not isinstance(value, list):
        fail(source, "preprocess", "an array of tables ([[preprocess]])", value)
    stages = tuple(_image_input(item, source, f"preprocess[{i}]") for i, item in enumerate(value))
    _unique([s.input for s in stages], source, "preprocess", "input")
    _unique([s.tensor for s in stages if s.tensor], source, "preprocess", "tensor")
    return stages


def parse_postprocess(value: object, source: str) -> tuple[OutputStage, ...]:
    if not isinstance(value, list):
        fail(source, "postprocess", "an array of tables ([[postprocess]])", value)
    stages = tuple(_output_stage(item, source, f"postprocess[{i}]") for i, item in enumerate(value))
    _unique([s.name for s in stages], source, "postprocess", "name")
    return stages


def _image_input(item: object, source: str, at: str) -> ImageInput:
    t = check_table(item, source, at, _PRE)
    k = at + "."
    size = None
    if "size" in t:
        size = _pair(t["size"], source, k + "size")
    resize = check_choice(t.get("resize", "stretch"), source, k + "resize", RESIZE_MODES)
    shorter = None
    if "shorter_side" in t:
        shorter = check_int(t["shorter_side"], source, k + "shorter_side", 1)
        if shorter > MAX_SIDE:
            fail(source, k + "shorter_side", f"at most {MAX_SIDE}", shorter)
        if resize != "shorter_side":
            fail(source, k + "resize", "'shorter_side' when shorter_side is given", resize)
    formats = t.get("formats", list(IMAGE_FORMATS))
    if not isinstance(formats, list) or not formats:
        fail(source, k + "formats", "a non-empty list of image formats", formats)
    checked_formats = tuple(
        check_choice(f, source, f"{k}formats[{i}]", IMAGE_FORMATS) for i, f in enumerate(formats)
    )
    scale = None
    if "scale" in t:
        scale = check_number(t["scale"], source, k + "scale", True)
    mean = _floats(t.get("mean", []), source, k + "mean", positive=False)
    std = _floats(t.get("std", []), source, k + "std", positive=True)
    color = check_choice(t.get("color", "rgb"), source, k + "color", COLORS)
    channels = 1 if color == "gray" else 3
    for key, values in (("mean", mean), ("std", std)):
        if values and len(values) not in (1, channels):
            fail(source, k + key, f"1 or {channels} numbers (one per channel)", list(values))
    datatype = None
    if "datatype" in t:
        numeric = tuple(sorted(d for d in DATATYPES if d not in ("BYTES", "BOOL")))
        datatype = check_choice(t["datatype"], source, k + "datatype", numeric)
    return ImageInput(
        input=check_name(t.get("input", "image"), source, k + "input"),
        tensor=check_name(t["tensor"], source, k + "tensor") if "tensor" in t else None,
        formats=checked_formats,
        resize=resize,
        size=size,
        shorter_side=shorter,
        interpolation=check_choice(
            t.get("interpolation", "bilinear"), source, k + "interpolation", INTERPOLATIONS
        ),
        color=color,
        scale=scale,
        mean=mean,
        std=std,
        layout=check_choice(t["layout"], source, k + "layout", LAYOUTS) if "layout" in t else None,
        datatype=datatype,
        max_pixels=check_int(t.get("max_pixels", DEFAULT_MAX_PIXELS), source, k + "max_pixels", 1),
        decoder=check_choice(t.get("decoder", "auto"), source, k + "decoder", DECODERS),
        scaled_decode=check_bool(t.get("scaled_decode", True), source, k + "scaled_decode"),
        exif_orientation=check_bool(
            t.get("exif_orientation", False), source, k + "exif_orientation"
        ),
    )


def _output_stage(item: object, source: str, at: str) -> OutputStage:
    t = check_table(item, source, at, _POST)
    k = at + "."
    if "output" not in t:
        raise ConfigError(f"{source}: key '{k}output' is required")
    output = check_name(t["output"], source, k + "output")
    top_k = check_int(t.get("top_k", 0), source, k + "top_k")
    argmax = check_bool(t.get("argmax", False), source, k + "argmax")
    if top_k and argmax:
        fail(source, k + "argmax", "false when top_k is set (pick one)", argmax)
    labels = None
    if "labels" in t:
        labels = check_name(t["labels"], source, k + "labels")
        if (
            labels.startswith("/")
            or ".." in labels.replace("\\", "/").split("/")
            or any(ord(c) < 0x20 for c in labels)  # (a NUL had failed the load: a 503)
        ):
            fail(source, k + "labels", "a file name inside the model's folder", labels)
    return OutputStage(
        output=output,
        name=check_name(t.get("name", output), source, k + "name"),
        softmax=check_bool(t.get("softmax", False), source, k + "softmax"),
        top_k=top_k,
        argmax=argmax,
        labels=labels,
    )


def _pair(value: object, source: str, key: str) -> tuple[int, int]:
    expected = f"[height, width], each from 1 to {MAX_SIDE}"
    if not isinstance(value, list) or len(value) != 2:
        fail(source, key, expected, value)
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SIDE:
            fail(source, key, expected, value)
    return int(value[0]), int(value[1])


def _floats(value: object, source: str, key: str, positive: bool) -> tuple[float, ...]:
    if not isinstance(value, list):
        fail(source, key, "a list of numbers", value)
    out = []
    for i, v in enumerate(value):
        if positive:
            out.append(check_number(v, source, f"{key}[{i}]", True))
        elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            fail(source, f"{key}[{i}]", "a finite number", v)
        else:
            out.append(float(v))
    return tuple(out)


def _unique(names: list[str], source: str, table: str, key: str) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(f"{source}: key '{table}[{i}].{key}': {name!r} is used twice")
        seen.add(name)
