"""The tuning report: a table per model (like Model Analyzer's summary) and a
throughput-vs-latency plot per model as a self-contained SVG (no plotting
library in the cloud tier): one line per backend and thread count, one point
per batch size, the objective's half as a dashed line."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def table(name: str, entry: dict[str, Any], latency_ms: float) -> str:
    chosen = entry.get("chosen")
    rows = []
    for t in entry["trials"]:
        for p in t["points"]:
            mark = ""
            if chosen and (t["backend"], t["threads"], p["batch"]) == (
                chosen["backend"],
                chosen["threads"],
                chosen["batch"],
            ):
                mark = "  <- chosen"
            rows.append(
                f"  {t['backend']:<12}{t['threads']:>8}{p['batch']:>6}{p['p50_ms']:>10.2f}"
                f"{p['p99_ms']:>10.2f}{p['throughput']:>12.1f}{t['memory_bytes'] / (1 << 20):>9.1f}{mark}"
            )
    fits = ", ".join(
        f"{t['backend']}/{t['threads']}t: l(b) = {t['a_s'] * 1000:.2f} + {t['beta_s'] * 1000:.3f}*b ms"
        f" (+-{t['spread_s'] * 1000:.2f})"
        for t in entry["trials"]
    )
    head = (
        f"model {name} (objective {latency_ms:g} ms: batch p99 <= {latency_ms / 2:g} ms)\n"
        f"  {'backend':<12}{'threads':>8}{'batch':>6}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'items/s':>12}{'mem MiB':>9}"
    )
    skipped = "".join(f"\n  skipped {b}: {why}" for b, why in entry.get("skipped", {}).items())
    verdict = (
        f"  best: {chosen['backend']}, {chosen['threads']} threads, batch {chosen['batch']}: "
        f"{chosen['throughput']:.1f} items/s at p99 {chosen['p99_ms']:.2f} ms"
        if chosen
        else "  best: nothing meets the objective"
    )
    return "\n".join([head, *rows, f"  fits: {fits}", verdict]) + skipped + "\n"


def svg(name: str, entry: dict[str, Any], latency_ms: float) -> str:
    width, height, pad = 640, 400, 60
    series = [(f"{t['backend']} {t['threads']}t", t["points"]) for t in entry["trials"]]
    xs = [p["p99_ms"] for _, pts in series for p in pts] + [latency_ms / 2]
    ys = [p["throughput"] for _, pts in series for p in pts] or [1.0]
    x_max, y_max = max(xs) * 1.1 or 1.0, max(ys) * 1.1 or 1.0

    def sx(v: float) -> float:
        return pad + v / x_max * (width - 2 * pad)

    def sy(v: float) -> float:
        return height - pad - v / y_max * (height - 2 * pad)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">'
        f"{escape(name)}: throughput vs p99 latency</text>",
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">p99 latency of a batch (ms)</text>',
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
        f'text-anchor="middle">items/s</text>',
    ]
    for i in range(5):
        xv, yv = x_max * i / 4, y_max * i / 4
        out.append(
            f'<text x="{sx(xv):.1f}" y="{height - pad + 15}" text-anchor="middle">{xv:.1f}</text>'
        )
        out.append(f'<text x="{pad - 5}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
    half = sx(latency_ms / 2)
    out.append(
        f'<line x1="{half:.1f}" y1="{pad}" x2="{half:.1f}" y2="{height - pad}" '
        'stroke="grey" stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{half + 3:.1f}" y="{pad + 10}" fill="grey">objective / 2</text>')
    for k, (label, pts) in enumerate(series):
        colour = _COLOURS[k % len(_COLOURS)]
        path = " ".join(f"{sx(p['p99_ms']):.1f},{sy(p['throughput']):.1f}" for p in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}"/>')
        for p in pts:
            out.append(
                f'<circle cx="{sx(p["p99_ms"]):.1f}" cy="{sy(p["throughput"]):.1f}" r="3" '
                f'fill="{colour}"><title>{escape(label)} batch {p["batch"]}</title></circle>'
            )
        out.append(
            f'<text x="{width - pad - 100}" y="{pad + 14 * k}" fill="{colour}">{escape(label)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_report(folder: Path, doc: dict[str, Any]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    latency = doc["latency_objective_ms"]
    for name, entry in doc["models"].items():
        for suffix, text in (
            (".txt", table(name, entry, latency)),
            (".svg", svg(name, entry, latency)),
        ):
            path = folder / f"{name}{suffix}"
            path.write_text(text)
            written.append(path)
    return written
