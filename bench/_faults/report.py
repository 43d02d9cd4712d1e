"""The fault suite's table, for the terminal and for ``docs/reliability.md``."""

from __future__ import annotations

import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from bench._faults.harness import DEADLINE_MS, MARGIN_S, NORMAL_RUN, Result

HEADERS = ["scenario", "sent", "ok", "(cloud / local / deferred)", "typed errors", "lost",
           "time to normal", "wall"]  # fmt: skip


def _row(r: Result) -> list[str]:
    if r.skipped:
        return [r.name, "-", "-", "-", f"skipped: {r.skipped}", "-", "-", f"{r.wall_s:.0f} s"]
    errors = ", ".join(f"{code} {n}" for code, n in sorted(r.errors.items())) or "0"
    normal = "never" if r.recovery_s is None else f"{r.recovery_s:.2f} s"
    return [
        r.name + (" FAIL" if r.failed else ""),
        str(r.sent),
        str(r.ok),
        f"{r.ok_cloud} / {r.ok_local} / {r.ok_deferred}",
        errors,
        str(r.lost),
        normal,
        f"{r.wall_s:.0f} s",
    ]


def text_table(results: list[Result]) -> str:
    rows = [HEADERS, *(_row(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in results]
    return "\n".join(lines)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _lost_summary(r: Result) -> list[str]:
    """Lost requests grouped by what happened to them (their detail, less the time)."""
    groups: dict[str, int] = {}
    for d in r.lost_details:
        what = d.split(": ", 1)[1] if ": " in d else d
        groups[what] = groups.get(what, 0) + 1
    return [f"LOST {n}: {what}" for what, n in groups.items()]


def write_markdown(
    path: Path, results: list[Result], descriptions: dict[str, str], quick: bool, wall_s: float
) -> None:
    scenarios = "\n".join(f"- **{name}**: {text}." for name, text in descriptions.items())
    notes = []
    for r in results:
        for n in [*_lost_summary(r), *r.problems, *r.notes]:
            first = n.splitlines()[0] if n else n
            notes.append(f"- {r.name}: {first}")
    failed = [r.name for r in results if r.failed]
    verdict = (
        "Every scenario met the target."
        if not failed
        else "Missed the target: "
        + ", ".join(f"**{n}**" for n in failed)
        + " (reproduce one with `.venv/bin/python bench/faults.py --only NAME`)."
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {_cpu_count()} cores, Python {platform.python_version()}"
    text = f"""# Reliability: the fault-injection suite

Ferry is meant to answer every request, whatever breaks: with a result (from
a cloud node, or from the device's local variant after a failed offload),
with a deferral receipt that is later delivered, or with a typed error (an
`ErrorCode` such as `overloaded` or `deadline_exceeded`). This suite breaks
things for real (`ferry-cloud` processes, a Mosquitto broker, the live link
emulator, a file system) while a real edge agent (`edge.agent.Agent`, in
process) serves a steady stream of requests, and counts what became of each.

Reproduce (the disk scenarios mount a small tmpfs, which needs root; they are
skipped elsewhere):

```bash
.venv/bin/python bench/faults.py            # every scenario; writes this file
.venv/bin/python bench/faults.py --quick    # shorter phases (what tests/test_faults.py runs)
.venv/bin/python bench/faults.py --only kill-node --dump out/   # one scenario, each request's fate
```

Every request is its own task with a {DEADLINE_MS:g} ms deadline, 10 to 20
per second. The stream mostly alternates two models: `lin` is offloaded
whenever the cloud is usable (`mode = "cloud"`) and falls back to its local
variant; `solo` exists only in the cloud, so what goes wrong there reaches the
app as a typed error. bad-model adds `broken` (cloud only), memory-budget
`big` (128 KiB requests, cloud only), and the disk scenarios send `solo` as
deferrable with no link. The models take 10-15 ms of real compute, so requests
are in flight when a fault hits.

Scenarios:

{scenarios}

Columns: **sent** requests; **ok** answered with a result (by a cloud node /
on the device / a deferral receipt); **typed errors** by code; **lost**: no
answer within the deadline plus {MARGIN_S:g} s, an exception that is not a
typed error, or a deferral receipt never delivered; **time to normal**: from
the end of the fault (the kill, `SIGCONT`, the broker back, the link back, the
disk freed, the fixed model loaded, the last burst) to the first of
{NORMAL_RUN} requests in a row answered as before it (by a cloud node; for
disk-full, with a receipt; for disk-full-flush, until the whole backlog is
delivered). Target: 0 lost everywhere, every overload answered explicitly.
`bench/faults.py` exits 1 when a scenario loses a request, a process dies that
the scenario did not kill, or the requests never come back to normal.

## Results

Measured {stamp} on {machine}, commit {_commit()}{", --quick" if quick else ""};
the whole run took {wall_s:.0f} s. {verdict}

{markdown_table(results)}

What each run saw:

{chr(10).join(notes) or "- nothing of note"}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1
