"""Read a Triton ``config.pbtxt`` so a Triton model repository serves as it is.

A team moving from Triton brings folders with ``config.pbtxt`` (protobuf text
format, Triton's ``ModelConfig`` message).  Ignoring it would serve every
model with Ferry's defaults (another batch size, other versions, no labels),
found only in production.  So each field Ferry has a meaning for is mapped to
the ``config.toml`` key that means the same, and checked by the same code;
every other field is either refused (it changes what a request computes or
how requests relate: ``sequence_batching``, ``ensemble_scheduling``,
``batch_input``, decoupled models, optional inputs) or named in
a warning as ignored (tuning only: ``optimization``, ``model_warmup``,
``parameters``, ``response_cache``; Ferry warms every model up itself).

Mapping: ``platform``/``backend`` -> ``backend`` (``onnxruntime_onnx`` and
``onnxruntime``, ``openvino``, ``tensorrt_plan`` and ``tensorrt``,
``tflite``); ``max_batch_size``; ``input``/``output`` ``name``,
``data_type`` (``TYPE_FP32`` ...; ``TYPE_STRING`` is ``BYTES``), ``dims``,
``reshape`` (:mod:`shared.runtimes.reshape`);
an output's ``label_filename`` -> a ``[[postprocess]]`` stage with
``labels`` (Triton's classification extension reads it);
``dynamic_batching`` (``preferred_batch_size``,
``max_queue_delay_microseconds``, ``priority_levels``,
``default_priority_level``, ``default_queue_policy``'s
``default_timeout_microseconds``, ``max_queue_size`` and
``allow_timeout_override``); ``instance_group`` (counts summed; one kind);
``version_policy`` (``latest``/``all``/``specific``).  ``name``, when given,
must be the folder's, as Triton requires.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.repository.checks import fail
from shared.repository.config import TOP_KEYS, ModelConfig, json_object, parse_config_dict
from shared.repository.legacy import legacy_datatype

log = logging.getLogger(__name__)

TRITON_CONFIG_FILE = "config.pbtxt"

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\n,;]+|\#[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<punct>[{}\[\]:<>])
    """,
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a"}
_CLOSE = {"{": "}", "<": ">"}
#: deeper nesting than any Triton config has: a bound, not a limit anyone meets
_MAX_DEPTH = 32


def parse_text_proto(text: str, source: str) -> dict[str, list[Any]]:
    """Protobuf text format as ``{field: [values]}`` (every field a list, as any may repeat).

    Messages become dicts of the same form; enum values and identifiers stay
    strings, ``true``/``false`` become booleans, numbers ints or floats.
    """
    tokens = _tokens(text, source)
    _, fields = _message(tokens, 0, None, source, 0)
    return fields


def _tokens(text: str, source: str) -> list[tuple[str, Any, int]]:
    out: list[tuple[str, Any, int]] = []
    pos, line = 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ConfigError(f"{source}: line {line}: cannot read {text[pos : pos + 20]!r}")
        kind = m.lastgroup
        value = m.group()
        if kind == "string":
            out.append(("string", _unquote(value[1:-1], source, line), line))
        elif kind == "number":
            out.append(("number", _number(value, source, line), line))
        elif kind in ("ident", "punct"):
            out.append((kind, value, line))
        line += value.count("\n")
        pos = m.end()
    return out


def _unquote(body: str, source: str, line: int) -> str:
    """A string's text: escapes are bytes (protobuf writes non-ASCII text as octal
    UTF-8 bytes, ``"\\303\\251"`` for é), so the result is decoded as UTF-8."""
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ESCAPES:
            out += _ESCAPES[nxt].encode()
            i += 2
        elif nxt in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i + 1 :]).group()  # type: ignore[union-attr]
            out.append(int(digits, 8) & 0xFF)
            i += 1 + len(digits)
        elif nxt in "xX" and re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :]):
            digits = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :]).group()  # type: ignore[union-attr]
            out.append(int(digits, 16))
            i += 2 + len(digits)
        else:
            raise ConfigError(f"{source}: line {line}: unknown escape '\\{nxt}' in a string")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: line {line}: a string is not valid UTF-8") from None


def _number(text: str, source: str, line: int) -> int | float:
    t = text.rstrip("fF") if not text.lower().startswith(("0x", "-0x", "+0x")) else text
    try:
        if re.fullmatch(r"[-+]?0[xX][0-9a-fA-F]+", t):
            return int(t, 16)
        if re.fullmatch(r"[-+]?\d+", t):
            return int(t)
        return float(t)
    except ValueError:
        raise ConfigError(f"{source}: line {line}: not a number: {text!r}") from None


def _message(
    tokens: list[tuple[str, Any, int]], pos: int, close: str | None, source: str, depth: int
) -> tuple[int, dict[str, list[Any]]]:
    if depth > _MAX_DEPTH:
        raise ConfigError(f"{source}: messages nested more than {_MAX_DEPTH} deep")
    fields: dict[str, list[Any]] = {}
    while pos < len(tokens):
        kind, value, line = tokens[pos]
        if close is not None and kind == "punct" and value == close:
            return pos + 1, fields
        if kind != "ident":
            raise ConfigError(f"{source}: line {line}: expected a field name, got {value!r}")
        name = value
        pos += 1
        if pos >= len(tokens):
            raise ConfigError(f"{source}: line {line}: field {name!r} has no value")
        colon = tokens[pos][0] == "punct" and tokens[pos][1] == ":"
        if colon:
            pos += 1
        if pos >= len(tokens):
            raise ConfigError(f"{source}: line {line}: field {name!r} has no value")
        kind, value, line = tokens[pos]
        if kind == "punct" and value in _CLOSE:
            pos, sub = _message(tokens, pos + 1, _CLOSE[value], source, depth + 1)
            fields.setdefault(name, []).append(sub)
        elif kind == "punct" and value == "[":  # 'input [ {...} ]': no colon before messages
            pos += 1
            while True:
                if pos >= len(tokens):
                    raise ConfigError(f"{source}: line {line}: list of {name!r} is not closed")
                kind, value, line = tokens[pos]
                if kind == "punct" and value == "]":
                    pos += 1
                    break
                if kind == "punct" and value in _CLOSE:
                    pos, sub = _message(tokens, pos + 1, _CLOSE[value], source, depth + 1)
                    fields.setdefault(name, []).append(sub)
                else:
                    pos, scalar = _scalar(tokens, pos, name, source)
                    fields.setdefault(name, []).append(scalar)
        elif colon:
            pos, scalar = _scalar(tokens, pos, name, source)
            fields.setdefault(name, []).append(scalar)
        else:
            raise ConfigError(f"{source}: line {line}: expected ':' or '{{' after {name!r}")
    if close is not None:
        raise ConfigError(f"{source}: a message is not closed (missing {close!r})")
    return pos, fields


def _scalar(
    tokens: list[tuple[str, Any, int]], pos: int, name: str, source: str
) -> tuple[int, Any]:
    kind, value, line = tokens[pos]
    if kind == "string":  # adjacent strings concatenate
        parts = [value]
        pos += 1
        while pos < len(tokens) and tokens[pos][0] == "string":
            parts.append(tokens[pos][1])
            pos += 1
        return pos, "".join(parts)
    if kind == "number":
        return pos + 1, value
    if kind == "ident":
        return pos + 1, {"true": True, "false": False, "True": True, "False": False}.get(
            value, value
        )
    raise ConfigError(f"{source}: line {line}: field {name!r}: expected a value, got {value!r}")


# ---- Triton's ModelConfig -> config.toml keys ------------------------------------------------

_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "tensorrt_plan": "tensorrt",
    "tensorrt": "tensorrt",
    "tflite": "litert",
    "armnn_tflite": "litert",
    "litert": "litert",
}
#: fields that change what a request computes or how requests relate: refused
_REFUSED = {
    "sequence_batching": "sequence batching (stateful models) is not supported",
    "ensemble_scheduling": "ensembles are not supported (Ferry's [[preprocess]] and "
    "[[postprocess]] stages cover image decoding and classification)",
    "batch_input": "batch inputs are not supported",
    "batch_output": "batch outputs are not supported",
}
#: fields that only tune how Triton runs the model: ignored, with a warning
_IGNORED = (
    "optimization",
    "model_warmup",
    "parameters",
    "response_cache",
    "model_operations",
    "model_repository_agents",
    "metric_tags",
    "cc_model_filenames",
    "runtime",
    "model_transaction_policy",
    "default_model_filename",
)
_QUEUE = (
    "timeout_action",
    "default_timeout_microseconds",
    "allow_timeout_override",
    "max_queue_size",
)
_GROUP = ("name", "count", "kind", "gpus", "profile", "passive", "host_policy", "rate_limiter")
_GROUP += ("secondary_devices",)
_KNOWN = (
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
    "instance_group",
    "version_policy",
    *_REFUSED,
    *_IGNORED,
)


def _one(fields: dict[str, list[Any]], key: str, default: Any = None) -> Any:
    values = fields.get(key)
    if not values:
        return default
    return values[-1]  # protobuf: the last value of a singular field wins


def _msg(fields: dict[str, list[Any]], key: str, source: str, at: str) -> dict[str, list[Any]]:
    value = _one(fields, key, {})
    if not isinstance(value, dict):
        fail(source, at + key, "a message ({ ... })", value)
    return value


def _check_fields(fields: dict[str, list[Any]], known: tuple[str, ...], source: str, at: str):
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(at + k for k in unknown)} "
            f"(Triton's ModelConfig fields Ferry reads: {', '.join(known)})"
        )


def _tensor(item: Any, source: str, at: str, output: bool) -> tuple[dict[str, Any], str | None]:
    if not isinstance(item, dict):
        fail(source, at, "a message ({ name: ... data_type: ... dims: [...] })", item)
    known = ("name", "data_type", "dims", "format", "label_filename", "reshape", "optional")
    known += ("is_shape_tensor", "allow_ragged_batch", "is_non_linear_format_io")
    _check_fields(item, known, source, at + ".")
    for key in ("is_shape_tensor", "allow_ragged_batch", "optional"):
        value = _one(item, key)
        if value not in (None, False, {}):
            raise ConfigError(f"{source}: key '{at}.{key}': not supported by Ferry")
    for required in ("name", "data_type", "dims"):
        if required not in item:
            raise ConfigError(f"{source}: key '{at}.{required}' is required")
    spec = {
        "name": _one(item, "name"),
        "datatype": legacy_datatype(_one(item, "data_type"), source, at + ".data_type"),
        "dims": list(item["dims"]),
    }
    if "reshape" in item:  # (``shape: [ ]`` reads as no field: an empty shape, a scalar)
        reshape = _msg(item, "reshape", source, at + ".")
        _check_fields(reshape, ("shape",), source, at + ".reshape.")
        spec["reshape"] = list(reshape.get("shape", []))
    labels = _one(item, "label_filename")
    if labels is not None and not output:
        raise ConfigError(f"{source}: key '{at}.label_filename': only an output has labels")
    return spec, labels


def triton_config_dict(fields: dict[str, list[Any]], source: str, name: str) -> dict[str, Any]:
    """Ferry's ``config.toml`` keys for a parsed ``config.pbtxt``."""
    _check_fields(fields, _KNOWN, source, "")
    for key, why in _REFUSED.items():
        if key in fields:
            raise ConfigError(f"{source}: key '{key}': {why}")
    ignored = [k for k in _IGNORED if k in fields]
    policy = _msg(fields, "model_transaction_policy", source, "")
    if _one(policy, "decoupled") is True:
        raise ConfigError(
            f"{source}: key 'model_transaction_policy.decoupled': decoupled models (many "
            "responses per request) are not supported"
        )
    filename = _one(fields, "default_model_filename")
    if filename is not None and not str(filename).startswith("model."):
        raise ConfigError(
            f"{source}: key 'default_model_filename': Ferry reads model.onnx, model.xml, "
            f"model.tflite or model.plan in each version folder; rename {filename!r}"
        )
    # settled above: not ignored, honoured
    ignored = [
        k for k in ignored if k not in ("model_transaction_policy", "default_model_filename")
    ]
    given = _one(fields, "name")
    if given is not None and given != name:
        raise ConfigError(f"{source}: key 'name': {given!r} is not the folder's name {name!r}")

    out: dict[str, Any] = {}
    engine = _one(fields, "backend") or _one(fields, "platform")
    if engine:
        if engine not in _BACKENDS:
            raise ConfigError(
                f"{source}: key '{'backend' if 'backend' in fields else 'platform'}': "
                f"{engine!r} is not a runtime Ferry runs (it runs {sorted(set(_BACKENDS))})"
            )
        out["backend"] = _BACKENDS[engine]
    if "max_batch_size" in fields:
        out["max_batch_size"] = _one(fields, "max_batch_size")
    post = []
    for key, output in (("input", False), ("output", True)):
        specs = []
        for i, item in enumerate(fields.get(key, [])):
            spec, labels = _tensor(item, source, f"{key}[{i}]", output)
            specs.append(spec)
            if labels:
                post.append({"output": spec["name"], "labels": labels})
        if specs:
            out[key] = specs
    if post:
        out["postprocess"] = post

    if "dynamic_batching" in fields:
        db = _msg(fields, "dynamic_batching", source, "")
        at = "dynamic_batching."
        known = ("preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering")
        known += ("priority_levels", "default_priority_level", "default_queue_policy")
        known += ("priority_queue_policy",)
        _check_fields(db, known, source, at)
        batching: dict[str, Any] = {}
        if "preferred_batch_size" in db:
            batching["preferred_batch_sizes"] = list(db["preferred_batch_size"])
        for theirs, ours in (
            ("max_queue_delay_microseconds", "max_queue_delay_us"),
            ("priority_levels", "priority_levels"),
            ("default_priority_level", "default_priority_level"),
        ):
            if theirs in db:
                batching[ours] = _one(db, theirs)
        if "preserve_ordering" in db:
            batching["preserve_ordering"] = _one(db, "preserve_ordering")
        if batching.get("priority_levels") == 0:
            batching.pop("priority_levels")  # Triton's 0: no priorities (Ferry's 1)
            batching.pop("default_priority_level", None)
        elif "priority_levels" in batching and "default_priority_level" not in batching:
            # (Triton refuses it; read as level 1, requests without a priority had
            # jumped every prioritised one)
            raise ConfigError(
                f"{source}: key '{at}default_priority_level': required with priority_levels "
                f"(a level from 1 to {batching['priority_levels']})"
            )
        if "priority_queue_policy" in db:  # per-level queue bounds decide refusals
            raise ConfigError(
                f"{source}: key '{at}priority_queue_policy': per-priority queue policies are "
                "not supported (default_queue_policy applies to every level)"
            )
        queue = _msg(db, "default_queue_policy", source, at)
        qat = at + "default_queue_policy."
        _check_fields(
            queue,
            _QUEUE,
            source,
            qat,
        )
        action = _one(queue, "timeout_action", "REJECT")
        if action != "REJECT":
            raise ConfigError(
                f"{source}: key '{qat}timeout_action': {action!r} is not supported (a request "
                "past its timeout is always answered with a deadline error: REJECT)"
            )
        if "default_timeout_microseconds" in queue:
            batching["default_timeout_us"] = _one(queue, "default_timeout_microseconds")
        if "allow_timeout_override" in queue:
            batching["allow_timeout_override"] = _one(queue, "allow_timeout_override")
        if "max_queue_size" in queue:
            batching["max_queue_size"] = _one(queue, "max_queue_size")
        out["dynamic_batching"] = batching

    groups = fields.get("instance_group", [])
    if groups:
        count, kinds = 0, set()
        for i, group in enumerate(groups):
            at = f"instance_group[{i}]."
            if not isinstance(group, dict):
                fail(source, at[:-1], "a message ({ count: ... kind: ... })", group)
            _check_fields(
                group,
                _GROUP,
                source,
                at,
            )
            # (Triton's placement of instances on devices and its rate limiter: Ferry's
            # node runs its instances itself; said, as the other ignored settings are)
            ignored.extend(f"{at}{k}" for k in _GROUP[3:] if k in group)
            n = _one(group, "count", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                fail(source, at + "count", "an integer >= 1", n)
            count += n
            kind = _one(group, "kind", "KIND_AUTO")
            if kind not in ("KIND_CPU", "KIND_GPU", "KIND_AUTO"):
                fail(source, at + "kind", "KIND_CPU, KIND_GPU or KIND_AUTO", kind)
            if kind == "KIND_AUTO":  # Triton: a GPU where the backend has one
                kind = "KIND_GPU" if out.get("backend") == "tensorrt" else "KIND_CPU"
            kinds.add(kind)
        if len(kinds) > 1:
            raise ConfigError(
                f"{source}: key 'instance_group': CPU and GPU instances of one model are not "
                "supported; use one kind"
            )
        out["instance_group"] = {"count": count, "kind": kinds.pop()[5:].lower()}

    if "version_policy" in fields:
        vp = _msg(fields, "version_policy", source, "")
        at = "version_policy."
        _check_fields(vp, ("latest", "all", "specific"), source, at)
        if "latest" in vp:
            latest = _msg(vp, "latest", source, at)
            _check_fields(latest, ("num_versions",), source, at + "latest.")
            out["version_policy"] = {"latest": _one(latest, "num_versions", 1)}
        elif "all" in vp:
            out["version_policy"] = {"all": True}
        elif "specific" in vp:
            specific = _msg(vp, "specific", source, at)
            _check_fields(specific, ("versions",), source, at + "specific.")
            out["version_policy"] = {"specific": list(specific.get("versions", []))}
    if ignored:
        log.warning(
            "%s: ignored Triton setting(s) %s (they tune how Triton runs the model; "
            "Ferry warms up and sizes threads itself: see [runtime] in config.toml)",
            source,
            ", ".join(ignored),
        )
    return out


#: integer fields protobuf's JSON may write as strings (int64: ``"dims": ["4"]``)
_INTEGERS = frozenset(
    (
        "dims",
        "shape",
        "max_batch_size",
        "num_versions",
        "versions",
        "count",
        "gpus",
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "priority_levels",
        "default_priority_level",
        "default_timeout_microseconds",
        "max_queue_size",
    )
)
#: keys that only Triton's ModelConfig has (``runtime`` is both's: Triton's names a
#: backend library, Ferry's is a table, told apart below)
_TRITON_ONLY = frozenset((*_KNOWN, *_IGNORED, *_REFUSED)) - set(TOP_KEYS)


#: what only Ferry's config can say: a load override that leaves one out keeps the
#: repository's (Triton's JSON never names them)
FERRY_SECTIONS = ("preprocess", "postprocess", "runtime", "placement")


def parse_load_config(
    text: object, name: str, source: str = "load request: parameter 'config'"
) -> tuple[ModelConfig, frozenset[str]]:
    """A load request's ``config``: Triton's ``ModelConfig`` JSON (what Triton's
    clients send, and what ``GET /v2/models/{m}/config`` answers), or the keys of
    Ferry's ``config.toml`` (tried as Triton's where they do not read as Ferry's).
    With it, the :data:`FERRY_SECTIONS` it does not name, which the caller keeps
    from the repository: Triton's JSON names none, and a partial override
    (``{"max_batch_size": 4}``) means to change only what it says."""
    data = json_object(text, source)
    named = {k for k in FERRY_SECTIONS if k in data}
    if not isinstance(data.get("runtime"), dict):
        named.discard("runtime")  # (Triton's runtime: a backend library's name)
    keep = frozenset(FERRY_SECTIONS) - named
    if not _looks_triton(data):
        try:
            return parse_config_dict(data, source, name), keep
        except ConfigError as ferry_error:  # (a uint64 as a string, a nested camelCase)
            try:
                fields = _proto_fields(data)
                triton = triton_config_dict(fields, source, name)
                return parse_config_dict(triton, source, name), frozenset(FERRY_SECTIONS)
            except ConfigError:
                raise ferry_error from None
    if named:  # Ferry's own tables in Triton's form: they had been dropped without a word
        key = sorted(named)[0]
        raise ConfigError(
            f"{source}: key {key!r}: Ferry's [{key}] table in a config written in Triton's "
            "form (ModelConfig JSON: instance_group as a list, Triton's field names); "
            "send config.toml's keys throughout to set it, or leave it out to keep the "
            "repository's"
        )
    fields = _proto_fields(data)
    triton = triton_config_dict(fields, source, name)
    return parse_config_dict(triton, source, name), frozenset(FERRY_SECTIONS)


def keep_ferry_sections(
    override: ModelConfig, base: ModelConfig, keep: frozenset[str]
) -> ModelConfig:
    """``override`` with the repository's ``keep`` sections (a Triton override's labels
    files make post-processing stages of its own, which stand)."""
    kept = {k: getattr(base, k) for k in keep if k != "postprocess"}
    if "postprocess" in keep and not override.postprocess:
        kept["postprocess"] = base.postprocess
    return replace(override, **kept)


def _snake(key: str) -> str:
    """protobuf's JSON names fields in lowerCamelCase too (``maxBatchSize``)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower() if key != key.lower() else key


def _looks_triton(data: dict[str, Any]) -> bool:
    keys = {_snake(str(k)) for k in data}
    if keys & _TRITON_ONLY or keys - set(data):  # (camelCase is protobuf's JSON)
        return True
    if isinstance(data.get("runtime"), str):
        return True
    if isinstance(data.get("instance_group"), list):  # (Ferry's is a table)
        return True
    if isinstance(data.get("version_policy"), dict) and any(
        isinstance(v, dict) for v in data["version_policy"].values()
    ):
        return True
    batching = data.get("dynamic_batching")
    if isinstance(batching, dict) and {_snake(str(k)) for k in batching} & {
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "default_queue_policy",
        "preserve_ordering",
    }:
        return True
    return any(
        isinstance(t, dict) and ("data_type" in t or "dataType" in t)
        for key in ("input", "output")
        for t in (data.get(key) if isinstance(data.get(key), list) else [])
    )


def _proto_fields(message: dict[str, Any]) -> dict[str, list[Any]]:
    """A JSON message in the form :func:`parse_text_proto` gives (every field a list)."""
    out: dict[str, list[Any]] = {}
    for key, value in message.items():
        field = _snake(str(key))
        values = value if isinstance(value, list) else [value]
        out[field] = [
            _proto_fields(v)
            if isinstance(v, dict)
            else int(v)
            if field in _INTEGERS and isinstance(v, str) and re.fullmatch(r"-?\d{1,19}", v)
            else v
            for v in values
        ]
    return out


def parse_triton_config(path: Path, name: str) -> ModelConfig:
    """Read ``config.pbtxt``; errors name the file and the field (Triton's name)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(f"{path}: cannot read: {reason}") from None
    fields = parse_text_proto(text, source)
    data = triton_config_dict(fields, source, name)
    try:
        return replace(parse_config_dict(data, source, name), source=path)
    except ConfigError as exc:  # (checked under Ferry's names: said under Triton's)
        raise ConfigError(_triton_names(exc.message)) from None


#: Ferry's config.toml key -> the config.pbtxt field it comes from, in error messages
_TRITON_NAMES = (
    ("dynamic_batching.max_queue_delay_us", "dynamic_batching.max_queue_delay_microseconds"),
    ("dynamic_batching.preferred_batch_sizes", "dynamic_batching.preferred_batch_size"),
    (
        "dynamic_batching.default_timeout_us",
        "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    ),
    ("dynamic_batching.max_queue_size", "dynamic_batching.default_queue_policy.max_queue_size"),
    (
        "dynamic_batching.allow_timeout_override",
        "dynamic_batching.default_queue_policy.allow_timeout_override",
    ),
    ("inputs[", "input["),
    ("outputs[", "output["),
)


def _triton_names(message: str) -> str:
    def rename(match: re.Match[str]) -> str:
        key = match.group(1)
        for ferry, triton in _TRITON_NAMES:
            if key.startswith(ferry):
                key = triton + key[len(ferry) :]
                break
        return f"key '{key}'"

    return re.sub(r"key '([^']*)'", rename, message)
