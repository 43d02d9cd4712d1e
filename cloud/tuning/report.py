"""The tuning report: a table per model (like Model Analyzer's summary) and a
throughput-vs-latency plot per model as a self-contained SVG (no plotting
library in the cloud tier): one line per backend and thread count, one point
per batch size, the objective's half as a dashed line."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _label(trial: dict[str, Any]) -> str:
    return trial["backend"] + ("*" if trial.get("converted") else "")


def _verdict(kind: str, choice: dict[str, Any]) -> str:
    return (
        f"  {kind}: {choice['backend']}, {choice['threads']} thread"
        f"{'' if choice['threads'] == 1 else 's'}, batch {choice['batch']}: "
        f"{choice['throughput']:.1f} items/s at p99 {choice['p99_ms']:.2f} ms"
    )


def table(name: str, entry: dict[str, Any], latency_ms: float) -> str:
    """Model Analyzer's summary for one model: every point, the fits, the verdict."""
    lines = [
        f"model {name} (objective {latency_ms:g} ms: batch p99 <= {latency_ms / 2:g} ms)",
        f"  {'backend':<13}{'threads':>7}{'batch':>6}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'items/s':>11}{'MiB':>8}",
    ]
    if entry.get("error"):
        lines.append(f"  not tuned: {entry['error']}")
    chosen = entry.get("chosen") or {}
    key = (chosen.get("backend"), chosen.get("threads"), chosen.get("batch"))
    for t in entry["trials"]:
        for p in t["points"]:
            mark = "  <- chosen" if (t["backend"], t["threads"], p["batch"]) == key else ""
            lines.append(
                f"  {_label(t):<13}{t['threads']:>7}{p['batch']:>6}{p['p50_ms']:>10.2f}"
                f"{p['p99_ms']:>10.2f}{p['throughput']:>11.1f}"
                f"{t['memory_bytes'] / (1 << 20):>8.1f}{mark}"
            )
    for t in entry["trials"]:
        lines.append(
            f"  fit {_label(t)} {t['threads']}t: l(b) = {t['a_s'] * 1000:.4g} + "
            f"{t['beta_s'] * 1000:.4g}*b ms (spread {t['spread_s'] * 1000:.3g} ms, "
            f"batches {','.join(str(b) for b in t.get('fit_batches', []))})"
        )
    if entry.get("chosen"):
        lines.append(_verdict("best", entry["chosen"]))
    elif entry["trials"]:
        lines.append("  best: nothing meets the objective")
    elif not entry.get("error"):
        lines.append("  best: nothing could be measured (see skipped)")
    if entry.get("converted_best"):
        lines.append(_verdict("better once converted", entry["converted_best"]))
    if any(t.get("converted") for t in entry["trials"]):
        lines.append("  * measured on an IR converted from model.onnx in a temporary folder;")
        src = f"{name}/{entry.get('version', '<version>')}/model.onnx"
        lines.append(f"    to serve it: ferry-cloud model convert <repository>/{src} --to openvino")
    lines.extend(f"  skipped {b}: {why}" for b, why in entry.get("skipped", {}).items())
    lines.extend(f"  note: {n}" for n in entry.get("notes", []))
    return "\n".join(lines) + "\n"


def svg(name: str, entry: dict[str, Any], latency_ms: float) -> str:
    width, height, pad = 640, 400, 60
    series = [(f"{_label(t)} {t['threads']}t", t["points"]) for t in entry["trials"]]
    # the objective's half stays on the chart only while it does not squash the points
    xs = [p["p99_ms"] for _, pts in series for p in pts] or [latency_ms / 2]
    if latency_ms / 2 <= 3 * max(xs):
        xs.append(latency_ms / 2)
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
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">'
        "p99 latency of a batch (ms)</text>",
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
        f'text-anchor="middle">items/s</text>',
    ]
    for i in range(5):
        xv, yv = x_max * i / 4, y_max * i / 4
        out.append(
            f'<text x="{sx(xv):.1f}" y="{height - pad + 15}" text-anchor="middle">{xv:.1f}</text>'
        )
        out.append(f'<text x="{pad - 5}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
    if latency_ms / 2 <= x_max:
        half = sx(latency_ms / 2)
        out.append(
            f'<line x1="{half:.1f}" y1="{pad}" x2="{half:.1f}" y2="{height - pad}" '
            'stroke="grey" stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{half + 3:.1f}" y="{pad + 10}" fill="grey">objective / 2</text>')
    else:
        out.append(
            f'<text x="{width - pad}" y="{height - pad - 5}" text-anchor="end" fill="grey">'
            f"objective / 2 = {latency_ms / 2:g} ms, off the chart to the right</text>"
        )
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
            f'<text x="{width - pad - 100}" y="{pad + 14 * k}" fill="{colour}">'
            f"{escape(label)}</text>"
        )
    chosen = entry.get("chosen")
    for t in entry["trials"] if chosen else ():
        for p in t["points"]:
            if (t["backend"], t["threads"], p["batch"]) == (
                chosen["backend"],
                chosen["threads"],
                chosen["batch"],
            ):
                out.append(
                    f'<circle cx="{sx(p["p99_ms"]):.1f}" cy="{sy(p["throughput"]):.1f}" r="7" '
                    'fill="none" stroke="black"><title>chosen</title></circle>'
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
