"""Draw docs/img/pipeline_user.svg: one load as a user sees it, in public names only.

The module-level picture is the text diagram in docs/pipeline.md ("The structure"); this one
shows what a caller gives, what each option governs and what comes back. Plain SVG, no
dependencies, deterministic output (tests/faces/test_first_hour.py checks the committed file is
what this writes).

    python benchmarks/draw_pipeline.py [--out docs/img/pipeline_user.svg]
"""

from __future__ import annotations

import argparse
from html import escape
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "img" / "pipeline_user.svg"

#: (title, lines under it) of each stage, left to right
STAGES: list[tuple[str, list[str]]] = [
    (
        "your checkpoint",
        [
            "a local directory, file://,",
            "s3://, gs://, http(s)://",
            "DCP, safetensors,",
            "torch.save files",
        ],
    ),
    (
        "metadata",
        [
            "what is where: .metadata",
            "or the files' headers",
            "decoded by an allow-list:",
            "no checkpoint code runs",
        ],
    ),
    (
        "plan",
        [
            "the byte ranges your",
            "tensors need, split at",
            "chunk_size, merged",
            "below min_chunk_size",
        ],
    ),
    (
        "readers",
        [
            "concurrency reads in",
            "flight, each with its",
            "timeout and retries;",
            "stragglers hedged",
        ],
    ),
    ("buffer", ["bytes read, not yet", "copied: at most", "memory_budget", ""]),
    (
        "your tensors",
        [
            "each chunk copied into",
            "state_dict in place",
            "(CPU or GPU) while later",
            "chunks are still read",
        ],
    ),
]
#: what comes back, under the stage it comes from (index into STAGES)
RESULTS: list[tuple[int, str]] = [
    (3, "errors: one AsyncLoadError naming the file, byte range, key and attempts"),
    (5, "LoadStats (returned), progress(done, total) on the way"),
]
CALLS = "asyncload.load(state_dict, url, options=LoadOptions(...), storage_options={...})  ·  aload  ·  start_load"

BOX_W, BOX_H, GAP, LEFT, TOP = 170, 118, 34, 20, 64
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def svg() -> str:
    width = LEFT * 2 + len(STAGES) * BOX_W + (len(STAGES) - 1) * GAP
    height = TOP + BOX_H + 112
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
        "<defs><marker id='arrow' markerWidth='10' markerHeight='8' refX='9' refY='4' orient='auto'>"
        "<path d='M0,0 L10,4 L0,8 z' fill='#444'/></marker></defs>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        f"<text x='{width / 2}' y='24' text-anchor='middle' {FONT} font-size='15' font-weight='bold'>"
        "One load, as you call it</text>",
        f"<text x='{width / 2}' y='46' text-anchor='middle' {FONT} font-size='12' fill='#333'>{escape(CALLS)}</text>",
    ]
    for i, (title, lines) in enumerate(STAGES):
        x = LEFT + i * (BOX_W + GAP)
        fill = "#e8f0fb" if i not in (0, len(STAGES) - 1) else "#f3f3f3"
        out.append(
            f"<rect x='{x}' y='{TOP}' width='{BOX_W}' height='{BOX_H}' rx='8' fill='{fill}' stroke='#4a6fa5'/>"
        )
        out.append(
            f"<text x='{x + BOX_W / 2}' y='{TOP + 22}' text-anchor='middle' {FONT} font-size='13' "
            f"font-weight='bold'>{escape(title)}</text>"
        )
        for j, line in enumerate(lines):
            out.append(
                f"<text x='{x + BOX_W / 2}' y='{TOP + 44 + j * 17}' text-anchor='middle' {FONT} "
                f"font-size='11.5'>{escape(line)}</text>"
            )
        if i:
            x0 = x - GAP + 2
            out.append(
                f"<line x1='{x0}' y1='{TOP + BOX_H / 2}' x2='{x - 3}' y2='{TOP + BOX_H / 2}' stroke='#444' "
                "stroke-width='1.5' marker-end='url(#arrow)'/>"
            )
    for k, (stage, text) in enumerate(RESULTS):
        cx = LEFT + stage * (BOX_W + GAP) + BOX_W / 2
        y = TOP + BOX_H + 34 + k * 30
        out.append(
            f"<line x1='{cx}' y1='{TOP + BOX_H}' x2='{cx}' y2='{y - 12}' stroke='#444' stroke-width='1.2' "
            "stroke-dasharray='4 3' marker-end='url(#arrow)'/>"
        )
        anchor = "end" if stage == len(STAGES) - 1 else "middle"
        tx = cx + (BOX_W / 2 if anchor == "end" else 0)
        out.append(
            f"<text x='{tx}' y='{y + 2}' text-anchor='{anchor}' {FONT} font-size='12'>{escape(text)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.write_text(svg())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
