"""The agent's sans-IO decision core: policy, estimators, energy, breaker, the flow.

Every request runs through this package (a cost-mode decision prices each
transport, races it against the local run and weighs exploring it), so it
may be compiled: ``ferry-edge build-native`` (run by scripts/setup.sh)
builds its modules with mypyc into ``_compiled/``, beside a manifest of the
sources' hashes.  The compiled modules are used only while every source
they were built from is unchanged, so an edit is never shadowed by a stale
build: the package then runs its Python sources, and :data:`NATIVE` says
why.  ``FERRY_NATIVE=0`` keeps the Python sources regardless.
"""

from __future__ import annotations

import json
import os
import zlib
from importlib.machinery import EXTENSION_SUFFIXES

#: Where ``ferry-edge build-native`` puts the compiled modules and their manifest.
COMPILED = os.path.join(os.path.dirname(__file__), "_compiled")
MANIFEST = "manifest.json"


def digest(data: bytes) -> str:
    """A source's fingerprint in the manifest: a change check, not a defence (CRC-32 and
    length: hashlib would load OpenSSL into every agent, 3.5 MiB of resident memory)."""
    return f"{zlib.crc32(data):08x}-{len(data)}"


def native_status(compiled: str, sources: str) -> tuple[bool, str]:
    """(usable, why): whether ``compiled`` holds a build of ``sources`` as they are now.

    All or nothing: the compiled modules share one library, so one changed
    source (or a missing module, or another interpreter's build) rules out
    every compiled module.
    """
    try:
        with open(os.path.join(compiled, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        suffix, modules = manifest["suffix"], manifest["sources"]
        libraries = manifest["libraries"]
    except FileNotFoundError:
        return False, "not built (ferry-edge build-native)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable build manifest ({exc}): rebuild with ferry-edge build-native"
    if suffix not in EXTENSION_SUFFIXES:
        return False, f"built for another interpreter ({suffix}): rebuild"
    for library in libraries:
        if not os.path.exists(os.path.join(compiled, library)):
            return False, f"{library} is missing from the build: rebuild"
    for name, built in modules.items():
        try:
            with open(os.path.join(sources, name), "rb") as f:
                now = digest(f.read())
        except OSError:
            return False, f"{name} is gone since the build: rebuild"
        if now != built:
            return False, f"{name} changed since the build: rebuild with ferry-edge build-native"
    return True, f"compiled ({len(modules)} modules)"


def _choose() -> tuple[bool, str]:
    if os.environ.get("FERRY_NATIVE", "").strip() == "0":
        return False, "off (FERRY_NATIVE=0)"
    return native_status(COMPILED, os.path.dirname(__file__))


_native, _why = _choose()
#: "compiled (N modules)" or "python: <why the compiled build is not used>".
NATIVE: str = _why if _native else f"python: {_why}"
#: A build is there but does not match these sources (or this interpreter): the agent
#: says so at start, since it then decides at a fraction of the compiled speed.
STALE_BUILD: bool = not _native and os.path.exists(os.path.join(COMPILED, MANIFEST))
if _native:
    # Submodules are looked up along the package's __path__: the compiled ones first.
    __path__.insert(0, COMPILED)
