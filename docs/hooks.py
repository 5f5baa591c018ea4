"""mkdocs hook: render tables that live in code, so the site never keeps a second copy.

`{{ hardware_table }}` in a page becomes the chip table from `tpupedia.hardware`.
"""

from __future__ import annotations

from tpupedia import hardware

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


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - mkdocs hook signature
    if "{{ hardware_table }}" in markdown:
        markdown = markdown.replace("{{ hardware_table }}", _hardware_table())
    return markdown
