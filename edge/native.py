"""Compile the decision core (``edge.core``) with mypyc: ``ferry-edge build-native``.

The per-request decision is plain arithmetic over small objects, which
CPython runs several times slower than C: compiled, one cost-mode decision
with two transports takes about a third of the time (bench/policy_quality.py,
target 4, prints both).  The same sources run unchanged where no C compiler
is at hand; ``edge.core`` picks the build only while it matches them (see
its docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from shared.errors import ConfigError


def core_dir() -> Path:
    return Path(__file__).resolve().parent / "core"


def status() -> tuple[str, str]:
    """("current" | "absent" | "stale", why) for the build on disk, read afresh."""
    from edge.core import COMPILED, native_status

    return native_status(COMPILED, str(core_dir()))


def _fingerprints() -> dict[str, str]:
    from edge.core import MODULES, digest

    return {f"{m}.py": digest((core_dir() / f"{m}.py").read_bytes()) for m in MODULES}


def _check_toolchain() -> None:
    """Refuse before the 30 s of mypyc when the build cannot succeed here."""
    if os.name != "nt":  # (MSVC is found by setuptools itself)
        cc = os.environ.get("CC", "").split()
        found = shutil.which(cc[0]) if cc else shutil.which("cc") or shutil.which("gcc")
        if found is None:
            what = f"CC={cc[0]!r}" if cc else "a C compiler (cc or gcc)"
            raise ConfigError(f"building the compiled core needs {what}: none found")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise ConfigError(
            f"building the compiled core needs the Python headers ({include}/Python.h is "
            "missing): install them, e.g. apt-get install python3-dev"
        )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One build at a time per installation (two swapping folders at once lost one)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; builds are rare and by hand
        yield
        return
    with open(folder / ".native.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile(tmp: str, out: io.StringIO) -> Path:
    """mypyc and the C compiler; returns the folder holding the built libraries."""
    from edge.core import GROUP, MODULES

    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as exc:
        raise ConfigError(
            f"building the compiled core needs mypy and setuptools ({exc}): "
            "pip install 'ferry[native]'"
        ) from None
    # mypyc names modules by their path from the folder it runs in, and mypy takes that
    # folder for a source root: run where the packages are and, in site-packages, every
    # installed module is a "user module" (typing_extensions shadowed the stdlib stub and
    # mypy refused the build). So compile a copy of what the core needs, in a folder of
    # its own.
    installed = core_dir().parent.parent
    root = os.path.join(tmp, "src")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.pyd", "_compiled*")
    for package in ("devices", "shared"):
        shutil.copytree(installed / package, os.path.join(root, package), ignore=skip)
    os.makedirs(os.path.join(root, "edge"))
    shutil.copy2(installed / "edge" / "__init__.py", os.path.join(root, "edge"))
    shutil.copytree(core_dir(), os.path.join(root, "edge", "core"), ignore=skip)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            extensions = mypycify(
                [f"edge/core/{m}.py" for m in MODULES]
                # (errors in the modules they import are not theirs to fix here)
                + ["--follow-imports", "silent", "--ignore-missing-imports"]
                + ["--cache-dir", os.path.join(tmp, "mypy-cache")],
                opt_level="3",
                group_name=f"edge.core.{GROUP}",
                target_dir=os.path.join(tmp, "c"),
            )
            dist = Distribution({"name": "ferry-native", "ext_modules": extensions})
            dist.verbose = 0
            cmd = dist.get_command_obj("build_ext")
            cmd.build_lib = os.path.join(tmp, "lib")
            cmd.build_temp = os.path.join(tmp, "tmp")
            dist.run_command("build_ext")
    except SystemExit as exc:  # mypyc exits on type errors (printed to ``out``)
        detail = out.getvalue()[-2000:]
        raise ConfigError(f"mypyc refused edge/core (exit {exc.code}): {detail}") from None
    except Exception as exc:  # a compiler failure: setuptools' CompileError and kin
        raise ConfigError(
            f"compiling edge/core failed: {type(exc).__name__}: {exc} (the compiler's "
            "messages are above)"
        ) from None
    finally:
        os.chdir(cwd)
    return Path(tmp, "lib", "edge", "core")


def _publish(built: Path, sources: dict[str, str]) -> None:
    """Swap the new build in whole: a reader sees the old build or the new one."""
    from edge.core import COMPILED, MANIFEST

    libraries = sorted(
        p.name for p in built.iterdir() if any(p.name.endswith(s) for s in EXTENSION_SUFFIXES)
    )
    if not libraries:
        raise ConfigError(f"compiling edge/core left no extension modules in {built}")
    suffix = next(s for s in EXTENSION_SUFFIXES if libraries[0].endswith(s))
    staging = Path(tempfile.mkdtemp(prefix="_compiled.", dir=core_dir()))
    old = Path(COMPILED)
    trash = old.with_name(f"_compiled.old.{os.getpid()}")
    try:
        for name in libraries:
            shutil.copy2(built / name, staging / name)
        manifest = staging / MANIFEST
        manifest.write_text(
            json.dumps({"suffix": suffix, "libraries": libraries, "sources": sources}, indent=1)
            + "\n"
        )
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # (mkdtemp's 0700 kept every other user out)
        for path in staging.iterdir():
            path.chmod(0o666 & ~umask | (0o111 & ~umask if path.suffix != ".json" else 0))
            with open(path, "rb") as f:  # on disk before the swap (a power cut after it)
                os.fsync(f.fileno())
        if old.exists():
            old.rename(trash)
        staging.rename(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)


def build(force: bool = False) -> str:
    """Build the compiled core unless a current build is there; returns what was done.

    Raises ConfigError when the toolchain is missing, mypyc refuses the
    sources, a source changes during the build, or the folder is not writable.
    """
    state, why = status()
    if state == "current" and not force:
        return f"up to date: {why}"
    _check_toolchain()
    folder = core_dir()
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{folder} is not writable by this user: build where it is")
    out = io.StringIO()
    try:
        with _locked(folder), tempfile.TemporaryDirectory(prefix="ferry-native-") as tmp:
            for leftover in folder.glob("_compiled.*"):  # an interrupted build's
                shutil.rmtree(leftover, ignore_errors=True)
            before = _fingerprints()  # what the compiler is about to read
            built = _compile(tmp, out)
            if _fingerprints() != before:
                raise ConfigError("edge/core changed during the build: build again")
            _publish(built, before)
    except OSError as exc:
        raise ConfigError(f"installing the compiled core failed: {exc}") from None
    was = "" if state == "absent" else f"; it was {why}"
    return f"built {len(before)} modules into {folder / '_compiled'}{was}"


def remove() -> str:
    """Delete the build, its leftovers and its lock: pip installed none of them, so
    ``pip uninstall`` leaves them (and a leftover ``edge/`` shadowed a later install)."""
    from edge.core import COMPILED

    folder = core_dir()
    gone = [p for p in folder.glob("_compiled*") if p.is_dir()]
    try:
        for path in gone:
            shutil.rmtree(path)
        (folder / ".native.lock").unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"removing the compiled core failed: {exc}") from None
    return f"removed {COMPILED}" if gone else "nothing to remove"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument(
        "--check", action="store_true", help="only say whether the build is current (exit 1 if not)"
    )
    p.add_argument(
        "--remove",
        action="store_true",
        help="delete the build (pip does not know it: run this before pip uninstall)",
    )


def run(args: argparse.Namespace) -> int:
    """``--check``: which core this process runs (FERRY_NATIVE and a build that does not
    load included), exit 1 unless the compiled one; else build.  ConfigError goes to the
    caller (the CLI prints it with its code)."""
    if getattr(args, "remove", False):
        print(f"edge.core: {remove()}")
        return 0
    if getattr(args, "check", False):
        from edge.core import NATIVE

        print(f"edge.core: {NATIVE}")
        return 0 if NATIVE.startswith("compiled") else 1
    print(f"edge.core: {build(force=getattr(args, 'force', False))}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ferry-edge build-native", description=__doc__)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except ConfigError as exc:
        print(f"ferry-edge: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
