"""The compiled decision core: used only while it matches its sources, and deciding alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

import edge.core
from edge import native
from edge.core import MANIFEST, digest, native_status

ROOT = Path(__file__).resolve().parents[3]
SUFFIX = EXTENSION_SUFFIXES[0]


def _build(folder: Path, sources: Path, **override) -> None:
    """A build's manifest (and empty stand-ins for its libraries) for ``sources``."""
    (sources / "policy.py").write_text("X = 1\n")
    (sources / "flow.py").write_text("Y = 2\n")
    folder.mkdir()
    libraries = [f"policy{SUFFIX}", f"native__mypyc{SUFFIX}"]
    for name in libraries:
        (folder / name).write_bytes(b"")
    manifest = {
        "suffix": SUFFIX,
        "libraries": libraries,
        "sources": {n: digest((sources / n).read_bytes()) for n in ("policy.py", "flow.py")},
        **override,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_build_that_matches_its_sources_is_used(tmp_path):
    _build(tmp_path / "c", tmp_path)
    assert native_status(str(tmp_path / "c"), str(tmp_path)) == (True, "compiled (2 modules)")


def test_an_edited_source_rules_the_whole_build_out(tmp_path):
    _build(tmp_path / "c", tmp_path)
    (tmp_path / "flow.py").write_text("Y = 3\n")
    usable, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert not usable and "flow.py changed since the build" in why


def test_no_build_a_missing_library_or_another_interpreter_is_not_used(tmp_path):
    assert native_status(str(tmp_path / "none"), str(tmp_path)) == (
        False,
        "not built (ferry-edge build-native)",
    )
    _build(tmp_path / "c", tmp_path)
    (tmp_path / "c" / f"native__mypyc{SUFFIX}").unlink()
    usable, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert not usable and "missing" in why
    other = tmp_path / "o"
    other.mkdir()
    _build(other / "c", other, suffix=".cpython-299-foo.so")
    usable, why = native_status(str(other / "c"), str(other))
    assert not usable and "another interpreter" in why


def test_an_unreadable_manifest_is_reported_not_raised(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MANIFEST).write_text("{not json")
    usable, why = native_status(str(tmp_path / "c"), str(tmp_path))
    assert not usable and "unreadable build manifest" in why


def _python(env_native: str | None, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_NATIVE"}
    if env_native is not None:
        env["FERRY_NATIVE"] = env_native
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout


def test_ferry_native_0_keeps_the_python_sources():
    code = "import edge.core, edge.core.policy as p; print(edge.core.NATIVE, p.__file__)"
    out = _python("0", code)
    assert out.startswith("python: off (FERRY_NATIVE=0)") and out.strip().endswith("policy.py")


def _needs_build() -> None:
    """The built core where a C compiler is at hand (scripts/setup.sh builds it)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the agent runs the Python sources (covered elsewhere)")
    current, why = native.status()
    assert current, f"the compiled core is not current ({why}): run ferry-edge build-native"


# A commute with a tunnel (outages, rate swings), a heavy model, both transports: races,
# hedges, explorations, wake-ups, breakers and fallbacks all happen in it.
REPLAY = """
import json
from devices.profiles import load_device, load_link
from edge.core.policy import ModelPolicy, PolicyConfig, Weights
from edge.evaluation.evaluate import ComputeProfile, Workload, evaluate
from edge.netem.traces import commute
import edge.core, edge.core.policy as p
device = load_device("raspberry-pi-4b")
profile = ComputeProfile(
    tuple(0.1 + 0.001 * (i % 37) for i in range(200)),
    tuple(0.03 + 0.0007 * (i % 23) for i in range(200)),
    (0.95,), device.speed_factor,
)
config = PolicyConfig(
    weights=Weights(latency_s=1.0, energy_j=0.05, data_mb=0.01),
    models={"m": ModelPolicy(local_model="m-local", cloud_model="m")},
)
ev = evaluate(
    up=commute(240, seed=3), down=commute(240, seed=4), link=load_link("lte"),
    device=device, profile=profile, config=config, model="m",
    workload=Workload(count=200, rate_per_s=1.0, input_bytes=60_000, deadline_ms=1500.0),
    transports=("mqtt", "http"),
)
print(json.dumps({
    "core": edge.core.NATIVE, "file": p.__file__,
    "ferry": [repr(o) for o in ev.results["ferry"].outcomes],
}))
"""


def test_the_compiled_core_decides_exactly_as_the_python_sources():
    _needs_build()
    compiled = json.loads(_python(None, REPLAY))
    python = json.loads(_python("0", REPLAY))
    assert compiled["core"].startswith("compiled") and compiled["file"].endswith(SUFFIX)
    assert python["core"].startswith("python") and python["file"].endswith(".py")
    where = {o.split("where='")[1].split("'")[0] for o in python["ferry"]}
    assert len(where) >= 2, where  # decisions that matter: not one answer throughout
    assert compiled["ferry"] == python["ferry"]  # every outcome, to the last bit


def test_the_core_suite_passes_on_the_python_sources_too():
    """The rest of this folder runs on whichever core is current; here, on the sources."""
    env = {**os.environ, "FERRY_NATIVE": "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(Path(__file__).parent),
            "--ignore",
            str(Path(__file__)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_build_native_check_says_whether_the_build_is_current():
    _needs_build()
    out = subprocess.run(
        [sys.executable, "-m", "edge.cli", "build-native", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.startswith("edge.core: compiled"), out
    assert native.build().startswith("up to date")  # nothing to do: no rebuild
    assert edge.core.NATIVE.startswith(("compiled", "python: off"))
