"""Coverage-guided fuzzing of the decoders (atheris), bounded in time, and crasher replay.

Each target of :mod:`tests.fuzz.harnesses` runs in its own process (atheris
instruments the code under test as it is imported, and libFuzzer exits the
process when it is done), from the seed corpus, for ``FERRY_FUZZ_SECONDS``
seconds (default 5 in CI; ``FERRY_FUZZ_SEED`` fixes libFuzzer's seed).  A crash
leaves its input in the test's tmp folder; the failure message shows it and
the traceback.  Save such an input as
``tests/fuzz/crashers/<target>-<anything>`` and ``test_crasher_is_fixed``
replays it from then on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz import harnesses

ROOT = Path(__file__).resolve().parents[2]
CRASHERS = Path(__file__).resolve().parent / "crashers"
SECONDS = int(os.environ.get("FERRY_FUZZ_SECONDS", "5"))
#: a bound on executions as well as time (libFuzzer stops at whichever comes first)
RUNS = int(os.environ.get("FERRY_FUZZ_RUNS", "5000000"))


@pytest.mark.parametrize("target", list(harnesses.TARGETS))
def test_fuzz(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus, artifacts, scratch = tmp_path / "corpus", tmp_path / "artifacts", tmp_path / "scratch"
    for folder in (corpus, artifacts, scratch):
        folder.mkdir()
    for i, seed in enumerate(harnesses.seeds(target)):
        (corpus / f"seed-{i:03d}").write_bytes(seed)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "FERRY_FUZZ_SCRATCH": str(scratch),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.harnesses",
            target,
            f"-max_total_time={SECONDS}",
            f"-runs={RUNS}",
            f"-artifact_prefix={artifacts}/",
            "-timeout=20",  # one input running this long is a hang, reported as a crash
            "-rss_limit_mb=3072",
            "-print_final_stats=1",
            *(
                [f"-seed={os.environ['FERRY_FUZZ_SEED']}"]
                if "FERRY_FUZZ_SEED" in os.environ
                else []
            ),
            str(corpus),
        ],
        cwd=scratch,  # relative paths in fuzzed configs land in the scratch folder
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # atheris prints the Python traceback to stdout
        text=True,
        errors="replace",
        timeout=SECONDS + 180,
    )
    output = proc.stdout
    crashes = sorted(p for p in artifacts.iterdir() if p.is_file())
    found = "\n".join(f"{p.name}: {p.read_bytes()[:2000]!r}" for p in crashes)
    at = output.find("=== Uncaught Python exception")
    assert proc.returncode == 0 and not crashes, (
        f"atheris exited {proc.returncode} on {target}; inputs left:\n{found}\n\n"
        + (output[at : at + 6000] if at >= 0 else output[-6000:])
    )
    print(target, *(line for line in output.splitlines() if line.startswith("stat::")))


def _crashers() -> list[Path]:
    if not CRASHERS.is_dir():
        return []
    return sorted(p for p in CRASHERS.iterdir() if p.is_file() and not p.name.startswith("."))


@pytest.mark.parametrize("path", _crashers(), ids=lambda p: p.name)
def test_crasher_is_fixed(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every input fuzzing once crashed on now ends in a result or a FerryError."""
    target = path.name.split("-", 1)[0]
    assert target in harnesses.TARGETS, f"{path.name}: name it <target>-..., a target of harnesses"
    monkeypatch.setenv("FERRY_FUZZ_SCRATCH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    harnesses.TARGETS[target](path.read_bytes())
