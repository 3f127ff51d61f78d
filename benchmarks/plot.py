"""Draw the GPU benchmark's throughput as a bar chart (SVG, no plotting library).

    python benchmarks/plot.py OUT.svg RESULTS.jsonl [RESULTS.jsonl ...]

One bar per (engine, job) with a tokens/s median, longest first within a job.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LABELS = {
    "off-graphs": "vLLM, graphs (plugin off)",
    "on-graphs": "plugin, graphed engine",
    "on-taps": "plugin, graphed engine, tap (lowered)",
    "off-eager": "vLLM, eager (plugin off)",
    "on-eager": "plugin, eager engine",
    "nnsight": "nnsight's vLLM runner (eager)",
    "hf": "nnsight on HF transformers",
    "hotwire": "hotwire-vllm 0.1.2 (graphs)",
}
JOBS = ["plain", "steer", "plain256", "steer256", "plain1000", "capture1000", "capture64"]
COLORS = {"off": "#8a8a8a", "on": "#2b6cb0", "nnsight": "#c05621", "hf": "#2f855a", "hotwire": "#6b46c1"}


def medians(paths: list[str]) -> dict[tuple[str, str], float]:
    values: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if "tok_s" in row and row["engine"] in LABELS and row["job"] in JOBS:
                values.setdefault((row["engine"], row["job"]), []).append(row["tok_s"])
    return {key: statistics.median(v) for key, v in values.items()}


def svg(found: dict[tuple[str, str], float]) -> str:
    width, left, bar, gap = 900, 330, 18, 6
    top = max(found.values())
    rows, y = [], 40
    for job in JOBS:
        entries = sorted(((e, v) for (e, j), v in found.items() if j == job), key=lambda x: -x[1])
        if not entries:
            continue
        rows.append(f'<text x="10" y="{y + 12}" font-weight="bold">{job}</text>')
        y += bar + gap
        for engine, value in entries:
            length = (width - left - 90) * value / top
            color = COLORS[engine.split("-")[0]]
            rows.append(f'<text x="20" y="{y + 13}">{LABELS[engine]}</text>')
            rows.append(f'<rect x="{left}" y="{y}" width="{length:.1f}" height="{bar}" fill="{color}"/>')
            rows.append(f'<text x="{left + length + 6:.1f}" y="{y + 13}">{value:,.0f}</text>')
            y += bar + gap
        y += gap * 2
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 10}" '
        'font-family="sans-serif" font-size="13">'
        '<rect width="100%" height="100%" fill="white"/>'
        '<text x="10" y="22" font-size="15" font-weight="bold">Generated tokens/s, H200, '
        "Qwen3-8B shapes, bf16 (longer is faster)</text>"
    )
    return head + "".join(rows) + "</svg>\n"


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(svg(medians(sys.argv[2:])))
