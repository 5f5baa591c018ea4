"""Pictures of the course's six core ideas, drawn from the objects the code uses.

Each picture lives in a module of its own whose `draw(...)` takes the real thing, never a copy of
its numbers: the `Mesh` and a weight's `NamedSharding` (`mesh`), the shardings of an MLP's two
weights and the collectives its compiled program holds (`mlp_split`), the scores of a real query
and key block by block (`online_softmax`), a run's stage files (`stages`), the VAE's frame batches
and its causal kernel (`conv_cache`), and a mesh's devices with their processes (`hosts`). When
the object changes, the picture does.

A notebook shows each once, in a code cell tagged `diagram-NAME` (`DIAGRAMS` says which
notebook); a knowledge-base page that explains the same idea writes `{{ diagram:NAME }}`, and
the docs hook (`docs/hooks.py`) puts that cell's stored picture there (`figure_html`): the same
PNG in both places and both editions, redrawn whenever CI executes the notebook.

The modules share this one look (`canvas`, `box`, `arrow`, `COLORS`); introduced in notebook
`sharding`, whose mesh is the first picture.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from tpupedia.errors import TpupediaError

__all__ = ["DIAGRAMS", "COLORS", "DiagramError", "canvas", "box", "arrow", "color", "png", "figure_html", "render"]

DIAGRAMS: dict[str, tuple[str, str]] = {
    "mesh": ("02_sharding", "A device mesh, and what a PartitionSpec puts on each device"),
    "mlp-split": ("02_sharding", "An MLP split column-then-row over tp: one all-reduce"),
    "online-softmax": ("05_splash_attention", "Online softmax: one pass over the key blocks"),
    "conv-cache": ("06_cogvideox_vae_flax", "The causal conv cache across frame batches"),
    "stages": ("07_cogvideox_pipeline", "Three stages, joined by stage files"),
    "hosts": ("13_beyond_one_host", "Processes, hosts and chips in one mesh"),
}
"""Each diagram's name: the notebook (file stem) whose cell tagged `diagram-NAME` draws it, and
the caption pages print under it."""

COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
          "#9c755f", "#bab0ac")
"""One colour per device, block or stage, in order (Tableau 10: distinguishable, colour-blind aware)."""

INK = "#333333"
FONT = 9


class DiagramError(TpupediaError, KeyError):
    """A page names a diagram that does not exist, or its notebook cell holds no picture."""


def color(i: int) -> str:
    """The `i`-th colour of `COLORS`, wrapping around."""
    return COLORS[i % len(COLORS)]


def canvas(width: float, height: float, *, inches_per_unit: float = 0.9) -> tuple[Any, Any]:
    """A figure and an axis in drawing units (0..width, 0..height), no ticks or frame, y upwards."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width * inches_per_unit, height * inches_per_unit))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.99)
    return fig, ax


def box(ax: Any, x: float, y: float, w: float, h: float, text: str = "", *, fill: str = "white",
        edge: str = INK, size: float = FONT, alpha: float = 1.0, weight: str = "normal", **kw: Any) -> Any:
    """A rectangle with its lower-left corner at (x, y) and `text` centred in it."""
    from matplotlib.patches import FancyBboxPatch

    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06", facecolor=fill, edgecolor=edge,
                           linewidth=1.0, alpha=alpha, **kw)
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=INK, weight=weight)
    return patch


def arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], text: str = "", *,
          color: str = INK, size: float = FONT, style: str = "-|>", offset: tuple[float, float] = (0.0, 0.12)) -> None:
    """An arrow from `start` to `end`, with `text` beside its middle (moved by `offset`)."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color=color, lw=1.2, shrinkA=0, shrinkB=0))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text, ha="center",
                va="bottom", fontsize=size, color=color)


def png(name: str, root: Path) -> bytes:
    """The PNG stored in the output of the cell tagged `diagram-NAME` in its notebook under `root`."""
    if name not in DIAGRAMS:
        raise DiagramError(f"no diagram named {name!r}; known: {', '.join(DIAGRAMS)}")
    notebook = root / "notebooks" / f"{DIAGRAMS[name][0]}.ipynb"
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    tagged = [c for c in cells if f"diagram-{name}" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise DiagramError(f"{notebook.name}: {len(tagged)} cells tagged diagram-{name}; exactly one draws it")
    pictures = [o["data"]["image/png"] for o in tagged[0].get("outputs", []) if "image/png" in o.get("data", {})]
    if len(pictures) != 1:
        raise DiagramError(f"{notebook.name}: the cell tagged diagram-{name} stores {len(pictures)} pictures; "
                           "execute the notebook so it stores exactly one")
    data = pictures[0]
    return base64.b64decode("".join(data) if isinstance(data, list) else data)


_PLACEHOLDER = re.compile(r"\{\{ diagram:([\w-]+)(?: \| ([^}]+?))? \}\}")
"""`{{ diagram:NAME }}`, or `{{ diagram:NAME | caption }}` where a page (the Chinese edition) words
the caption itself."""


def figure_html(name: str, root: Path, caption: str | None = None) -> str:
    """An HTML `<figure>` holding diagram `name` as its notebook stores it, captioned and linked to
    the notebook that draws it (`root` is the `docs/` folder's parent; links are site-relative)."""
    data = base64.b64encode(png(name, root)).decode("ascii")
    stem, default = DIAGRAMS[name]
    return (f'<figure class="diagram" id="diagram-{name}"><img alt="{caption or default}" '
            f'src="data:image/png;base64,{data}"><figcaption>{caption or default} '
            f'(<code>{stem[3:]}</code>)</figcaption></figure>')


def render(markdown: str, root: Path) -> str:
    """`markdown` with every `{{ diagram:NAME }}` replaced by that diagram's `figure_html`."""
    return _PLACEHOLDER.sub(lambda m: figure_html(m.group(1), root, m.group(2)), markdown)
