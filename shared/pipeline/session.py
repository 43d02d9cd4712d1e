"""A model with its pre- and post-processing, behind the ordinary Session interface.

Both tiers load models through :func:`wrap`, so the same JPEG sent to the
agent or to the cloud goes through the same code, and batching, metadata
and validation see the tensors the client sends (a BYTES image per item)
and the outputs it gets.  ``run`` is called in the tier's worker thread
with a whole dynamic batch: images decode in parallel on a pool sized to
the cores (every decoder releases the GIL), then one vectorised normalise
turns the batch into the model's tensor.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shared.datatypes import numpy_dtype
from shared.errors import ConfigError, FerryError, InternalError, InvalidInput
from shared.pipeline import images
from shared.pipeline.post import argmax, read_labels, softmax, top_k
from shared.pipeline.spec import ImageInput, OutputStage
from shared.runtimes._common import check_inputs, check_outputs
from shared.runtimes.base import Cancel, Session, TensorSpec, available_cpus, cancellable

log = logging.getLogger(__name__)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def decode_pool() -> ThreadPoolExecutor:
    """The process's image-decoding pool, one thread per core (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(available_cpus(), thread_name_prefix="ferry-decode")
        return _pool


@dataclass(frozen=True)
class _Image:
    stage: ImageInput
    spec: TensorSpec  # the model tensor it feeds
    target: images.Target
    layout: str
    dtype: np.dtype
    gain: np.ndarray  # scale / std, shaped to broadcast over one item in the layout
    offset: np.ndarray | None  # -mean / std (None: no mean)
    batched: bool  # the tensor's first axis is the batch


@dataclass(frozen=True)
class _Output:
    stage: OutputStage
    labels: tuple[str, ...] | None
    leading: int  # axes kept as they are (1 with a batch axis; -1: all but the last)


class PipelineSession:
    """``inner`` with image inputs decoded before it and outputs post-processed after."""

    def __init__(
        self,
        inner: Session,
        pre: list[_Image],
        post: list[_Output],
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
    ) -> None:
        self.inner = inner
        self.backend = inner.backend
        self._pre = pre
        self._post = {p.stage.name: p for p in post}
        self.inputs = inputs
        self.outputs = outputs
        self._output_names = [s.name for s in outputs]
        #: output name -> labels, for Triton's classification extension: a labels file
        #: names the classes of the model output it is given for (and of a softmax of it)
        self.labels = {p.stage.output: p.labels for p in post if p.labels is not None}
        self.labels.update(
            {
                p.stage.name: p.labels
                for p in post
                if p.labels is not None and not (p.stage.top_k or p.stage.argmax)
            }
        )

    @property
    def cancellable(self) -> bool:
        return cancellable(self.inner)

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        return self._run(inputs, outputs, None)

    def run_cancellable(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel
    ) -> dict[str, np.ndarray]:
        """:meth:`run`, the model's run stopped halfway by ``cancel`` (its runtime's)."""
        if not self.cancellable:
            raise InternalError(f"{self.inner.backend} cannot cancel a run")
        return self._run(inputs, outputs, cancel)

    def _run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel | None
    ) -> dict[str, np.ndarray]:
        feed = check_inputs(self.inputs, inputs)
        for image in self._pre:
            feed[image.spec.name] = self._tensor(image, feed.pop(image.stage.input))
        wanted = check_outputs(self._output_names, outputs)
        needed = list(dict.fromkeys(self._source(name) for name in wanted))
        if cancel is None:
            raw = self.inner.run(feed, needed)
        else:
            raw = self.inner.run_cancellable(feed, needed, cancel)  # type: ignore[attr-defined]
        result = {}
        for name in wanted:
            stage = self._post.get(name)
            result[name] = raw[name] if stage is None else _apply(stage, raw[stage.stage.output])
        return result

    def sample_inputs(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Valid inputs of ``batch`` items: a textured image twice the model's size per
        image input (so decode and resize cost what a photo costs), zeros elsewhere."""
        from PIL import Image

        rng = np.random.default_rng(0)
        out: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            image = next((i for i in self._pre if i.stage.input == spec.name), None)
            rows = batch if spec.dims and spec.dims[0] == -1 else None
            rest = spec.dims[1:] if rows else spec.dims
            shape = tuple(([rows] if rows else []) + [d if d > 0 else 1 for d in rest])
            if not spec.ranked:
                shape = (batch,)
            if image is None:
                out[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
                continue
            h, w = 2 * image.target.height, 2 * image.target.width
            y, x = np.mgrid[0:h, 0:w]
            pixels = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], -1)
            pixels = np.clip(pixels + rng.normal(0, 8, pixels.shape), 0, 255).astype(np.uint8)
            fmt = "jpeg" if "jpeg" in image.stage.formats else image.stage.formats[0]
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, fmt.upper())
            arr = np.empty(shape, dtype=object)
            arr.fill(buffer.getvalue())
            out[spec.name] = arr
        return out

    def close(self) -> None:
        self.inner.close()

    # ---- internals -------------------------------------------------------------------------
    def _source(self, name: str) -> str:
        stage = self._post.get(name)
        return name if stage is None else stage.stage.output

    def _tensor(self, image: _Image, array: np.ndarray) -> np.ndarray:
        items = array.reshape(-1)
        blobs = []
        for i, item in enumerate(items.tolist()):
            if not isinstance(item, bytes | bytearray):
                raise InvalidInput(f"{image.target.where} item {i}: expected encoded image bytes")
            blobs.append(bytes(item))
        if not blobs:
            raise InvalidInput(f"{image.target.where}: no images (a batch of 0)")
        # the calling thread decodes the first image while the pool decodes the rest
        pool = decode_pool() if len(blobs) > 1 else None
        pending = [pool.submit(images.decode, b, image.target) for b in blobs[1:]] if pool else []
        decoded = []
        for i, blob in enumerate(blobs):
            try:
                decoded.append(pending[i - 1].result() if i else images.decode(blob, image.target))
            except FerryError as exc:
                for future in pending:
                    future.cancel()
                if len(blobs) == 1:
                    raise
                # which item of the batch is bad: the app's to fix or drop
                where = image.target.where
                said = exc.message.replace(where, f"{where} item {i}", 1)
                raise type(exc)(said if said != exc.message else f"item {i}: {said}") from None
        pixels = np.stack(decoded)  # (n, h, w, c) uint8
        return _normalise(image, pixels, array.shape[0] if image.batched else None)


def _changes(stage: OutputStage) -> bool:
    return stage.softmax or stage.top_k > 0 or stage.argmax


def _apply(stage: _Output, array: np.ndarray) -> np.ndarray:
    s = stage.stage
    if s.softmax:
        array = softmax(array)
    leading = stage.leading if stage.leading >= 0 else max(array.ndim - 1, 0)
    if s.top_k:
        return top_k(array, s.top_k, stage.labels, leading)
    if s.argmax:
        return argmax(array, stage.labels, leading)
    return array


def _normalise(image: _Image, pixels: np.ndarray, batch: int | None) -> np.ndarray:
    """(pixels * scale - mean) / std as one multiply-add per element, written in the
    model's layout: the transpose reads the uint8 pixels, not a float copy."""
    if image.layout == "NCHW":
        pixels = pixels.transpose(0, 3, 1, 2)
    out = np.empty(pixels.shape, dtype=np.float32)
    np.multiply(pixels, image.gain, out=out)
    if image.offset is not None:
        out += image.offset
    if image.dtype.kind in "iu":
        info = np.iinfo(image.dtype)
        np.rint(out, out=out)
        np.clip(out, info.min, info.max, out=out)
    if out.dtype != image.dtype:
        out = out.astype(image.dtype)
    return out if batch is not None else out[0]


# ---- building -----------------------------------------------------------------------------------


def wrap(
    session: Session,
    preprocess: tuple[ImageInput, ...],
    postprocess: tuple[OutputStage, ...],
    model_dir: Path | None,
    where: str,
) -> Session:
    """``session`` with the model's stages (itself when it has none).

    Everything the config left to the model file (the tensor fed, size,
    layout, datatype) is read from the session's own tensors here, so a
    mistake is a ConfigError at load time naming ``where`` and the key.
    """
    if not preprocess and not postprocess:
        return session
    pre = [_resolve_image(stage, i, session, where) for i, stage in enumerate(preprocess)]
    client_names = {p.stage.input: i for i, p in enumerate(pre)}
    inputs = []
    for spec in session.inputs:
        image = next((p for p in pre if p.spec.name == spec.name), None)
        if image is None:
            if spec.name in client_names:
                raise ConfigError(
                    f"{where}: key 'preprocess[{client_names[spec.name]}].input': "
                    f"{spec.name!r} is already a model input"
                )
            inputs.append(spec)
            continue
        dims = (image.spec.dims[0], 1) if image.batched else (1,)  # (its resolved dims)
        inputs.append(TensorSpec(image.stage.input, "BYTES", dims))
    post, outputs = _resolve_outputs(postprocess, session, model_dir, where)
    return PipelineSession(session, pre, post, inputs, outputs)


def _resolve_image(stage: ImageInput, index: int, session: Session, where: str) -> _Image:
    key = f"preprocess[{index}]"
    tensors = {s.name: s for s in session.inputs}
    if stage.tensor is None:
        candidates = [
            s
            for s in session.inputs
            if s.datatype != "BYTES" and (not s.ranked or len(s.dims) in (3, 4))
        ]
        if len(candidates) != 1:
            raise ConfigError(
                f"{where}: key '{key}.tensor' is required: the model has inputs "
                f"{sorted(tensors)}; name the one the image feeds"
            )
        spec = candidates[0]
    elif stage.tensor not in tensors:
        raise ConfigError(
            f"{where}: key '{key}.tensor': the model has no input {stage.tensor!r}; "
            f"its inputs are {sorted(tensors)}"
        )
    else:
        spec = tensors[stage.tensor]
    if not spec.ranked:  # any rank: fed as a batch of images, as a 4-dim input would be
        spec = replace(spec, dims=(-1, -1, -1, -1), ranked=True)
    if spec.datatype in ("BYTES", "BOOL") or len(spec.dims) not in (3, 4):
        raise ConfigError(
            f"{where}: key '{key}.tensor': input {spec.name!r} ({spec.datatype} {list(spec.dims)}) "
            "cannot take an image: it needs 3 dims (H, W, C or C, H, W) or 4 with a batch first"
        )
    batched = len(spec.dims) == 4
    dims = spec.dims[1:] if batched else spec.dims
    channels = 1 if stage.color == "gray" else 3
    layout = stage.layout or _guess_layout(dims, channels)
    h, w, c = (dims[1], dims[2], dims[0]) if layout == "NCHW" else dims
    if c not in (-1, channels):
        raise ConfigError(
            f"{where}: key '{key}.color': {stage.color!r} gives {channels} channel(s) but input "
            f"{spec.name!r} has {c} in layout {layout} (dims {list(spec.dims)}); set "
            f"'{key}.layout' if the layout is the other one"
        )
    if stage.size is not None:
        if h not in (-1, stage.size[0]) or w not in (-1, stage.size[1]):
            raise ConfigError(
                f"{where}: key '{key}.size': input {spec.name!r} is {h}x{w} "
                f"(layout {layout}), not {stage.size[0]}x{stage.size[1]}"
            )
        h, w = stage.size
    elif h < 1 or w < 1:
        raise ConfigError(
            f"{where}: key '{key}.size' is required: input {spec.name!r} has a dynamic "
            f"height or width (dims {list(spec.dims)})"
        )
    datatype = stage.datatype or spec.datatype
    if stage.datatype and stage.datatype != spec.datatype:
        raise ConfigError(
            f"{where}: key '{key}.datatype': input {spec.name!r} is {spec.datatype}, "
            f"not {stage.datatype}"
        )
    dtype = numpy_dtype(datatype)
    integer = dtype.kind in "iu"
    scale = stage.scale if stage.scale is not None else (1.0 if integer else 1.0 / 255.0)
    std = np.asarray(stage.std or (1.0,), dtype=np.float64)
    mean_given = stage.mean
    if not mean_given and stage.scale is None and dtype == np.int8:
        # An INT8 input (TFLite's full-integer image models) takes pixel - 128: the one
        # lossless map of 256 levels onto its range.  Pixels as they are clipped every
        # one above 127 (half an image) to 127, without a word.
        mean_given = (128.0,)
    mean = np.asarray(mean_given or (0.0,), dtype=np.float64)
    if integer:
        info = np.iinfo(dtype)
        ends = (np.array([0.0, 255.0])[:, None] * scale - mean) / std
        if ends.min() < info.min - 0.5 or ends.max() > info.max + 0.5:
            log.warning(
                "%s: key '%s': pixels map onto %.4g..%.4g, beyond %s's %d..%d: what falls "
                "outside is clipped (set scale, mean and std for this input's range)",
                where,
                key,
                ends.min(),
                ends.max(),
                datatype,
                info.min,
                info.max,
            )
    target = images.Target(
        height=h,
        width=w,
        color=stage.color,
        resize=stage.resize,
        shorter_side=stage.shorter_side,
        interpolation=stage.interpolation,
        formats=stage.formats,
        max_pixels=stage.max_pixels,
        decoder=stage.decoder,
        where=f"input {stage.input!r}",
        scaled_decode=stage.scaled_decode,
        exif_orientation=stage.exif_orientation,
    )
    if stage.decoder != "pillow" and not images.opencv_installed():
        # Without OpenCV, Pillow resizes, and its bilinear filter smooths a shrink
        # where OpenCV's samples: up to ~80 grey levels apart on a photo, so an
        # agent's local answer would differ from the cloud's (which has OpenCV).
        log.warning(
            "%s: key '%s.decoder': OpenCV is not installed, so images are resized with "
            "Pillow, which gives other pixels than a tier with OpenCV (pip install "
            'opencv-python-headless, or set decoder = "pillow" on every tier)',
            where,
            key,
        )
    return _Image(
        stage=stage,
        spec=spec,
        target=target,
        layout=layout,
        dtype=dtype,
        gain=_per_channel(np.float64(scale) / std, channels, layout),
        offset=_per_channel(-mean / std, channels, layout) if mean_given else None,
        batched=batched,
    )


def _per_channel(values: np.ndarray, channels: int, layout: str) -> np.ndarray:
    full = np.broadcast_to(values, (channels,)).astype(np.float32)
    return full.reshape(channels, 1, 1) if layout == "NCHW" else full


def _guess_layout(dims: tuple[int, ...], channels: int) -> str:
    """NCHW (PyTorch's) unless the last axis, not the first, holds the channels (TF's)."""
    return "NHWC" if dims[2] == channels and dims[0] != channels else "NCHW"


def _resolve_outputs(
    postprocess: tuple[OutputStage, ...], session: Session, model_dir: Path | None, where: str
) -> tuple[list[_Output], list[TensorSpec]]:
    by_name = {s.name: s for s in session.outputs}
    outputs = list(session.outputs)
    post = []
    for i, stage in enumerate(postprocess):
        key = f"postprocess[{i}]"
        spec = by_name.get(stage.output)
        if spec is None:
            raise ConfigError(
                f"{where}: key '{key}.output': the model has no output {stage.output!r}; "
                f"its outputs are {sorted(by_name)}"
            )
        if spec.datatype in ("BYTES", "BOOL") and _changes(stage):
            raise ConfigError(
                f"{where}: key '{key}.output': {stage.output!r} is {spec.datatype}; softmax, "
                "top_k and argmax need a numeric output"
            )
        if stage.name != stage.output and stage.name in by_name:
            raise ConfigError(
                f"{where}: key '{key}.name': {stage.name!r} is already a model output"
            )
        labels = None
        if stage.labels is not None:
            if model_dir is None:
                raise ConfigError(
                    f"{where}: key '{key}.labels': no model folder to read {stage.labels!r} from"
                )
            labels = read_labels(
                os.fspath(model_dir / stage.labels), f"{where}: key '{key}.labels'"
            )
        leading = 1 if spec.dims and spec.dims[0] == -1 else 0
        item = spec.dims[leading:]
        if labels is not None and spec.ranked and item and all(d > 0 for d in item):
            if len(labels) < int(np.prod(item)):
                log.warning(
                    "%s: key '%s.labels': %s has %d lines for %d classes; a class past them "
                    "is answered by its index",
                    where,
                    key,
                    stage.labels,
                    len(labels),
                    int(np.prod(item)),
                )
        if not spec.ranked:
            # Any rank: the classes are the last axis of whatever comes (-1: every axis
            # before it is kept, counted per run), and what comes out has any rank too.
            datatype = "FP32" if stage.softmax else spec.datatype
            if stage.top_k or stage.argmax:
                datatype = "BYTES" if stage.top_k or labels is not None else "INT64"
            new = TensorSpec(stage.name, datatype, (), ranked=False)
            leading = -1
        elif stage.top_k:
            classes = int(np.prod(item)) if item and all(d > 0 for d in item) else -1
            k = min(stage.top_k, classes) if classes > 0 else -1
            new = TensorSpec(stage.name, "BYTES", (*spec.dims[:leading], k))
        elif stage.argmax:
            new = TensorSpec(
                stage.name, "BYTES" if labels is not None else "INT64", (*spec.dims[:leading], 1)
            )
        else:
            new = TensorSpec(stage.name, "FP32" if stage.softmax else spec.datatype, spec.dims)
        if stage.name == stage.output:
            outputs[outputs.index(spec)] = new
        else:
            outputs.append(new)
        post.append(_Output(stage, labels, leading))
    return post, outputs
