"""Fault injection: does every request get an answer when things break for real?

    python bench/faults.py [--quick] [--only NAME[,NAME]] [--out docs/reliability.md]
        [--no-write] [-v]

Runs each scenario of ``bench/_faults`` (kill -9 of a node, SIGSTOP of a node,
a broker restart, a link outage through the live link emulator, a full disk
under the deferred store with no link and while it flushes, a corrupt model
file, an exhausted memory budget)
with real processes and a real Mosquitto, under a steady request stream
through a real edge agent, and prints per scenario: requests sent, answered
with a result, answered with a typed error (by code), LOST, and the time from
the fault's end until requests are answered as before.  Writes the table to
``docs/reliability.md`` (unless ``--only`` or ``--no-write``).

Exit status 1 when a scenario lost a request, a process died that the
scenario did not kill, requests never came back to normal after the fault,
or a scenario could not run at all; it says why.  ``--dump DIR`` writes
every request's fate (JSON lines) for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._faults import SCENARIOS, run_scenario  # noqa: E402
from bench._faults.harness import Result  # noqa: E402
from bench._faults.report import text_table, write_markdown  # noqa: E402


def dump(path: Path, result: Result) -> None:
    """One JSON line per request, times relative to the first one sent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = result.records[0].sent if result.records else 0.0
    with path.open("w") as out:
        for r in result.records:
            row = asdict(r)
            row["sent"] = round(r.sent - t0, 4)
            row["done"] = None if r.done is None else round(r.done - t0, 4)
            out.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (the tests' mode)")
    parser.add_argument("--only", help=f"comma-separated scenarios: {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--dump", type=Path, help="write each request's fate to DIR/NAME.jsonl")
    parser.add_argument("-v", "--verbose", action="store_true", help="agent logs on stderr")
    args = parser.parse_args(argv)
    names = list(SCENARIOS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    # The agent's warnings reach the scenarios' log tap either way; stderr only with -v.
    console = logging.StreamHandler()
    console.setLevel(logging.INFO if args.verbose else logging.CRITICAL + 1)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[console])
    started = time.monotonic()
    results = []
    for name in names:
        print(f"-- {name} ...", flush=True)
        result = asyncio.run(run_scenario(name, quick=args.quick))
        results.append(result)
        print(result.explain(), flush=True)
        if args.dump:
            dump(args.dump / f"{name}.jsonl", result)
    wall = time.monotonic() - started
    print()
    print(text_table(results))
    print(f"\n{len(results)} scenario(s) in {wall:.0f} s")
    if not args.no_write and not args.only:
        descriptions = {n: SCENARIOS[n][1] for n in names}
        write_markdown(args.out, results, descriptions, args.quick, wall)
        print(f"wrote {args.out}")
    failed = [r for r in results if r.failed]
    for r in failed:
        why = []
        if r.lost:
            why.append(f"{r.lost} request(s) lost")
        why += [p.splitlines()[0] for p in r.problems]
        print(f"FAIL {r.name}: " + "; ".join(why), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
