"""The model repository on disk.

Layout::

    <root>/<model>/config.toml          (or dl_inference's config.txt, or nothing)
    <root>/<model>/<version>/model.onnx | model.xml (+ model.bin) | model.tflite | model.plan

Model names arrive from clients (URLs, MQTT topics), so every name is checked
by :func:`validate_model_name` before it touches the file system: a name can
never leave ``root``.  Reading is all this class does; loading sessions and
keeping state belongs to each tier's dataplane.  :func:`complete_config`
checks a config against the session loaded from the version's file.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.errors import ConfigError, InvalidInput, ModelNotFound
from shared.repository.config import (
    DEFAULT_MAX_BATCH_SIZE,
    ModelConfig,
    check_preferred,
    parse_config,
)
from shared.repository.legacy import parse_legacy_config
from shared.repository.pbtxt import TRITON_CONFIG_FILE, parse_triton_config
from shared.runtimes import ALSO_READS, BACKENDS, MODEL_FILES
from shared.runtimes.base import Session, TensorSpec

log = logging.getLogger(__name__)

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
CONFIG_FILE = "config.toml"
LEGACY_CONFIG_FILE = "config.txt"


def validate_model_name(name: str) -> str:
    """Return ``name`` if it is a safe folder name, else raise InvalidInput.

    Allowed: 1-128 of ``[A-Za-z0-9_.-]``, not starting with ``.`` and never
    containing ``..``, so no name is a path separator, a parent reference or
    a hidden folder.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput("model name must be a non-empty string")
    shown = repr(name if len(name) <= 40 else name[:37] + "...")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInput(f"model name {shown} is longer than {MAX_NAME_LENGTH} characters")
    if not _NAME.fullmatch(name):
        raise InvalidInput(f"model name {shown} may only contain letters, digits, '_', '.' and '-'")
    if name.startswith(".") or ".." in name:
        raise InvalidInput(f"model name {shown} may not start with '.' or contain '..'")
    return name


_VERSION = re.compile(r"(0|[1-9][0-9]{0,17})", re.ASCII)


def parse_version(value: object) -> int:
    """A model version from a URL or a request: plain ASCII digits, nothing ``int()``
    would also take ("01", "+1", "1_0", " 1", non-ASCII digits alias real versions)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _VERSION.fullmatch(value):
        return int(value)
    raise InvalidInput(f"model version must be a plain non-negative integer, got {value!r}")


_LOOKS_LIKE_VERSION = re.compile(r"[vV]?\d")


def _misnamed_version(path: Path) -> bool:
    """A folder named like a version ('01', '1.0', 'v2'), holding a model file, that is
    not one: said, not passed over.  (Only such names: a docs/ folder holding an
    example model.onnx is no model; and no stat for a big data folder's entries.)"""
    name = path.name
    return (
        bool(_LOOKS_LIKE_VERSION.match(name))
        and not _is_version(path)
        and path.is_dir()
        and any(_model_path(path, f) for f in MODEL_FILES)
    )


def _is_version(path: Path) -> bool:
    """A version folder is named by a plain number ("01" is not: it would alias "1")."""
    name = path.name
    return name.isascii() and name.isdigit() and name == str(int(name)) and path.is_dir()


class ModelRepository:
    """Read-only view of a model repository folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._warned: set[str] = set()

    # ---- models --------------------------------------------------------------------------
    def _is_model(self, folder: Path) -> bool:
        if not folder.is_dir():
            return False
        if any(
            (folder / f).is_file() for f in (CONFIG_FILE, LEGACY_CONFIG_FILE, TRITON_CONFIG_FILE)
        ):
            return True
        # (a folder whose only versions are misnamed, '01' or '1.0', is a model that
        # says why it has no version: it had been passed over without a word)
        return any(_is_version(p) or _misnamed_version(p) for p in folder.iterdir())

    def model_names(self) -> list[str]:
        """Sorted names of the folders that look like models (others are ignored)."""
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} is not a folder")
        names = []
        for folder in self.root.iterdir():
            try:
                validate_model_name(folder.name)
            except InvalidInput as exc:
                # a model folder whose name no URL can carry: said (once), not skipped silently
                hidden = folder.name.startswith(".")
                if not hidden and folder.name not in self._warned and self._is_model(folder):
                    self._warned.add(folder.name)
                    log.warning("%s: not served: %s", folder, exc.message)
                continue
            if self._is_model(folder):
                names.append(folder.name)
        return sorted(names)

    def model_dir(self, name: str) -> Path:
        """The model's folder; ModelNotFound when no such model exists."""
        folder = self.root / validate_model_name(name)
        if not self._is_model(folder):
            raise ModelNotFound(f"model {name!r} is not in the repository {self.root}")
        return folder

    def read_config(self, name: str) -> ModelConfig:
        """``config.toml``, else ``config.txt`` (dl_inference), else ``config.pbtxt``
        (Triton), else all defaults."""
        folder = self.model_dir(name)
        if (folder / CONFIG_FILE).is_file():
            return parse_config(folder / CONFIG_FILE, name)
        if (folder / LEGACY_CONFIG_FILE).is_file():
            return parse_legacy_config(folder / LEGACY_CONFIG_FILE, name)
        if (folder / TRITON_CONFIG_FILE).is_file():
            return parse_triton_config(folder / TRITON_CONFIG_FILE, name)
        return ModelConfig(name=name)

    # ---- versions ------------------------------------------------------------------------
    def available_versions(self, name: str) -> list[int]:
        """Numeric version folders that hold a model file, ascending."""
        folder = self.model_dir(name)
        return sorted(
            int(p.name)
            for p in folder.iterdir()
            if _is_version(p) and any(_model_path(p, f) for f in MODEL_FILES)
        )

    def no_versions_why(self, name: str) -> str:
        """Why ``name`` has no version to serve, naming folders that hold a model file
        but are not version numbers ('01', '1.0', 'v1'): they had been passed over
        without a word."""
        try:
            found = self.available_versions(name)
        except OSError:
            found = []
        if found:
            return f"its version policy selects none of its versions {found}"
        try:
            odd = sorted(p.name for p in self.model_dir(name).iterdir() if _misnamed_version(p))
        except OSError:
            odd = []
        if not odd:
            return "no version folder holds a model file"
        named = ", ".join(repr(n) for n in odd[:5])
        return (
            f"no version folder holds a model file ({named} hold one, but a version folder "
            "is named by a plain number: 1, 2, ...)"
        )

    def fingerprint(self, name: str) -> tuple[Any, ...]:
        """What a rescan compares to tell a model changed on disk: its config files'
        and version folders' entries with their sizes and change times (a rewritten
        weights file or a new version folder differ; a read that finds nothing new
        does not).  Blocking: call it off the event loop."""
        folder = self.model_dir(name)
        marks: list[Any] = []
        for entry in sorted(folder.iterdir()):
            if entry.is_file():
                marks.append(_mark(entry))
            elif _is_version(entry):
                marks.append((entry.name, tuple(_mark(f) for f in sorted(entry.rglob("*")))))
        return tuple(marks)

    def selected_versions(self, name: str, config: ModelConfig | None = None) -> list[int]:
        """The versions the model's version policy serves."""
        config = config or self.read_config(name)
        try:
            return config.version_policy.select(self.available_versions(name))
        except ConfigError as exc:
            where = config.source or self.root / name
            raise ConfigError(f"{where}: key 'version_policy.specific': {exc.message}") from None

    def model_file(self, name: str, version: int, backend: str | None = None) -> tuple[str, Path]:
        """``(backend, path)`` of the file to load (the ``.xml`` for OpenVINO).

        With several model files in one version folder, ``backend`` (the
        config's) picks; without it the order is onnx, xml, tflite, plan.
        """
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(
                f"model {name!r}: unknown backend {backend!r}; expected one of {sorted(BACKENDS)}"
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"model version must be a non-negative integer, got {version!r}")
        folder = self.model_dir(name) / str(version)
        present = [(b, path) for f, b in MODEL_FILES.items() if (path := _model_path(folder, f))]
        if not present:
            raise ModelNotFound(f"model {name!r} has no version {version} with a model file")
        if backend is None:
            return present[0]
        for found_backend, path in present:
            if found_backend == backend:
                return found_backend, path
        for found_backend, path in present:
            # OpenVINO reads ONNX itself, as Triton's OpenVINO backend and OVMS do
            if backend in ALSO_READS.get(found_backend, ()):
                return backend, path
        files = ", ".join(f"{p.name} ({b})" for b, p in present)
        raise ConfigError(
            f"model {name!r}: the config says backend {backend!r} but version {version} "
            f"has only {files}"
        )

    def backends(self, name: str, version: int) -> list[str]:
        """Backends that serve ``version``'s files as they are: each file's own, then
        those that read it too (OpenVINO a model.onnx)."""
        folder = self.model_dir(name) / str(version)
        found = [b for f, b in MODEL_FILES.items() if _model_path(folder, f)]
        for own in list(found):
            found.extend(also for also in ALSO_READS.get(own, ()) if also not in found)
        return found

    # ---- index ---------------------------------------------------------------------------
    def index(self) -> list[dict[str, Any]]:
        """One entry per available version (``version`` is a string, as in Triton's
        index); a model without any gets one entry with ``version`` "" and the reason.
        State is UNAVAILABLE here: only the dataplane knows what is loaded."""
        entries: list[dict[str, Any]] = []
        for name in self.model_names():
            versions = self.available_versions(name)
            if not versions:
                entries.append(
                    {
                        "name": name,
                        "version": "",
                        "state": "UNAVAILABLE",
                        "reason": self.no_versions_why(name),
                    }
                )
            for version in versions:
                entries.append(
                    {"name": name, "version": str(version), "state": "UNAVAILABLE", "reason": ""}
                )
        return entries


def _mark(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError:  # gone between the listing and the stat: changed
        return (str(path), -1, -1)
    return (str(path), st.st_size, st.st_mtime_ns)


def _model_path(folder: Path, filename: str) -> Path | None:
    """``folder/filename``, or the file of that name inside a folder of that name
    (Triton's layout for an ONNX model with its external data: ``1/model.onnx/model.onnx``)."""
    path = folder / filename
    if path.is_file():
        return path
    inner = path / filename
    return inner if inner.is_file() else None


# ---- completion from the model file --------------------------------------------------------


def _declared_full_rank(config: ModelConfig, session: Session) -> bool:
    """Whether the config declares a tensor with the model file's whole rank: dims
    written with the batch axis (``dims: [-1, 4]`` for a [-1, 4] model), as a Triton
    config without ``max_batch_size`` (0 there) does for an unbatched model."""
    file_rank = {t.name: len(t.dims) for t in (*session.inputs, *session.outputs) if t.ranked}
    return any(
        spec.name in file_rank and len(spec.dims) == file_rank[spec.name]
        for spec in (*config.inputs, *config.outputs)
    )


def complete_config(config: ModelConfig, session: Session) -> ModelConfig:
    """Fill what the model file tells and check what the config claims against it.

    ``max_batch_size`` left out becomes :data:`DEFAULT_MAX_BATCH_SIZE` when
    every input and output of the file has a dynamic (-1) first dimension
    and no declared tensor is written with the file's whole rank, else 0
    (inferred: a bound on merged batches, not on requests).  Declared inputs must match the file's exactly (names, datatypes,
    fixed dims); declared outputs may be a subset (the rest stay hidden).
    """
    where = str(config.source) if config.source else f"model {config.name!r}"
    if config.backend is not None and config.backend != session.backend:
        raise ConfigError(
            f"{where}: key 'backend': config says {config.backend!r} but the model file "
            f"was loaded by {session.backend!r}"
        )
    found = list(session.inputs) + list(session.outputs)
    max_batch_size = config.max_batch_size
    inferred = max_batch_size is None
    if max_batch_size is None:
        batchable = bool(found) and all(t.dims and t.dims[0] == -1 for t in found)
        if batchable and _declared_full_rank(config, session):
            batchable = False  # dims given with the batch axis: served as declared, unbatched
        preferred = config.dynamic_batching.preferred_batch_sizes if config.dynamic_batching else ()
        max_batch_size = max((DEFAULT_MAX_BATCH_SIZE, *preferred)) if batchable else 0
    if max_batch_size > 0:
        for t in found:
            if t.ranked and (not t.dims or t.dims[0] != -1):  # (any rank takes a batch axis)
                raise ConfigError(
                    f"{where}: key 'max_batch_size': {max_batch_size} needs a dynamic (-1) first "
                    f"dimension, but tensor {t.name!r} in the model file has dims {list(t.dims)}; "
                    "set max_batch_size = 0 to serve it without a batch dimension"
                )
        strip = 1
    else:
        strip = 0
    file_in = [replace(t, dims=tuple(t.dims[strip:])) for t in session.inputs]
    file_out = [replace(t, dims=tuple(t.dims[strip:])) for t in session.outputs]
    note = " (batch dimension left out)" if strip else ""
    _check_stage_names(config, session, where)
    inputs = _merge(config.inputs, file_in, "input", where, note, exhaustive=True)
    outputs = _merge(config.outputs, file_out, "output", where, note, exhaustive=False)
    if (
        max_batch_size == 0
        and config.dynamic_batching
        and config.dynamic_batching.preferred_batch_sizes
    ):
        raise ConfigError(
            f"{where}: key 'dynamic_batching.preferred_batch_sizes': the model has no batch "
            "dimension (max_batch_size = 0), so preferred batch sizes cannot apply"
        )
    check_preferred(config.dynamic_batching, max_batch_size, where)
    return replace(
        config,
        backend=session.backend,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        max_batch_size_inferred=inferred and max_batch_size > 0,
    )


def _check_stage_names(config: ModelConfig, session: Session, where: str) -> None:
    """A [[preprocess]] or [[postprocess]] name the declared tensors do not carry is
    that stage's mistake: said so, rather than as a declared tensor the file lacks."""
    declared_in = sorted(t.name for t in config.inputs)
    for i, stage in enumerate(config.preprocess):
        if declared_in and stage.input not in declared_in:
            raise ConfigError(
                f"{where}: key 'preprocess[{i}].input': {stage.input!r} is not one of the "
                f"declared [[input]] names {declared_in}"
            )
    declared_out = {t.name for t in config.outputs}
    unmatched = sorted(declared_out - {t.name for t in session.outputs})
    for i, stage in enumerate(config.postprocess):
        if unmatched and stage.name not in declared_out:
            raise ConfigError(
                f"{where}: key 'postprocess[{i}].name': {stage.name!r} is not one of the "
                f"declared [[output]] names; the declared {unmatched} match no output"
            )


def _merge(
    declared: tuple[TensorSpec, ...],
    found: list[TensorSpec],
    kind: str,
    where: str,
    note: str,
    *,
    exhaustive: bool,
) -> tuple[TensorSpec, ...]:
    if not declared:
        return tuple(found)
    by_name = {t.name: t for t in found}
    merged = []
    for i, spec in enumerate(declared):
        key = f"{kind}[{i}]"
        actual = by_name.get(spec.name)
        if actual is None:
            raise ConfigError(
                f"{where}: key '{key}.name': the model file has no {kind} {spec.name!r}; "
                f"its {kind}s are {sorted(by_name)}"
            )
        if spec.datatype != actual.datatype:
            raise ConfigError(
                f"{where}: key '{key}.datatype': {kind} {spec.name!r} is {actual.datatype} "
                f"in the model file, not {spec.datatype}"
            )
        if not actual.ranked:  # the file allows any rank: the declared dims fix it
            merged.append(replace(spec, ranked=True))
            continue
        mismatch = len(spec.dims) != len(actual.dims) or any(
            c != a and c != -1 and a != -1 for c, a in zip(spec.dims, actual.dims, strict=False)
        )
        if mismatch:
            raise ConfigError(
                f"{where}: key '{key}.dims': {kind} {spec.name!r} has dims {list(actual.dims)} "
                f"in the model file{note}, not {list(spec.dims)}"
            )
        dims = tuple(c if c != -1 else a for c, a in zip(spec.dims, actual.dims, strict=True))
        merged.append(replace(spec, dims=dims))
    if exhaustive:
        undeclared = [n for n in by_name if n not in {t.name for t in declared}]
        if undeclared:
            raise ConfigError(
                f"{where}: key '{kind}': the model file also has {kind}s {undeclared} "
                "that the config does not declare"
            )
    return tuple(merged)
