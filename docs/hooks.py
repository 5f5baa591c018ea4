"""mkdocs hook: render tables that live in code, so the site never keeps a second copy.

`{{ hardware_table }}` in a page becomes the chip table from `tpupedia.hardware`.
"""

from __future__ import annotations

from pathlib import Path

from tpupedia import bench, hardware

_RESULTS = Path(__file__).parent / "results" / "benchmarks.json"

_COLUMNS = [
    "chip",
    "vendor",
    "HBM (GB)",
    "bf16 peak (TFLOP/s)",
    "HBM bandwidth (GB/s)",
    "ridge (FLOP/byte)",
    "link (GB/s)",
    "link type",
]


def _hardware_table() -> str:
    rows = hardware.table_rows()
    lines = ["| " + " | ".join(_COLUMNS) + " | source |", "|" + "---|" * (len(_COLUMNS) + 1)]
    for r in rows:
        cells = [str(r[c]) for c in _COLUMNS]
        note = f" ({r['note']})" if r["note"] else ""
        lines.append("| " + " | ".join(cells) + f" | [vendor page]({r['source']}){note} |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _bench_table() -> str:
    records = bench.load_results(_RESULTS)
    if not records:
        return "*No benchmark has been recorded yet.*"
    lines = [
        "| bench | config | measured on | PyTorch eager | torchax jit, first call | torchax jit, steady | jit / eager | max abs diff | date | command |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        c, m = r["config"], r["machine"]
        config = ", ".join(f"{k} {v}" for k, v in c.items())
        where = f"{m['device_kind']} ({m['platform']}, {m['cpu_count']} CPUs), torch {m['versions']['torch']}, jax {m['versions']['jax']}"
        lines.append(
            f"| {r['bench']} | {config} | {where} | {_ms(r['torch_eager']['steady_s'])} | "
            f"{r['torchax_jit']['first_s']:.2f} s | {_ms(r['torchax_jit']['steady_s'])} | "
            f"{r['ratio_jit_over_eager']:.2f} | {r['max_abs_diff']:.1e} | {r['measured_at']} | `{r['command']}` |"
        )
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - mkdocs hook signature
    if "{{ hardware_table }}" in markdown:
        markdown = markdown.replace("{{ hardware_table }}", _hardware_table())
    if "{{ bench_table }}" in markdown:
        markdown = markdown.replace("{{ bench_table }}", _bench_table())
    return markdown
