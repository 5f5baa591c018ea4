"""The stages of a staged pipeline and the stage files between them, drawn from the pipeline's
stage list (`tpupedia.pipelines.common.STAGE_ORDER`, `STAGE_INPUTS`, `request_stages`) and
the files a run wrote, as the stage-file reader checked them (`tpupedia.pipelines.stages.status`):
each file's tensors with their shapes and dtypes, its settings fingerprint and its checksum.

`layout(order, inputs, records)` says what goes where (pure: tested without a run); `draw(pipe,
request, workdir)` reads the run's files and renders it. Introduced in notebook
`cogvideox_pipeline` (section 8, the stage-file contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tpupedia.diagrams import FONT, INK, arrow, box, canvas, color

__all__ = ["Card", "Link", "Layout", "records", "layout", "draw"]

CALLS = {"text": "encode_text", "image": "encode_image", "denoise": "denoise", "decode": "decode"}
"""The `StagedPipeline` method each stage runs (what `common.run_stages` calls)."""

COLUMN, GAP, MARGIN = 3.3, 0.8, 0.25  # a stage's column, the gap its read arrows cross, the edge
STAGE_H, WRITE_GAP, LINE = 0.6, 0.45, 0.3  # a stage box, the arrow down to its file, one line of a card
CHECKS = ("Each arrow into a stage is stages.read: the JSON twin must exist; its settings must be this request's "
          "(the fingerprint);",
          "the tensor file's sha256 must match the twin's; the header's tensor names, shapes and dtypes must equal "
          "the twin's.",
          "Anything else is a StageError that names what differs.")


@dataclass(frozen=True)
class Card:
    """One stage: its box (name, the call it makes) and, under it, its file's card (the lines)."""

    stage: str
    ran: bool  # the request runs this stage (else drawn dashed: the pipeline has it, this run does not)
    x: float
    stage_y: float  # the stage box's lower edge
    card_y: float  # the file card's lower edge
    card_h: float
    lines: tuple[str, ...]  # the card's text, the file's name first


@dataclass(frozen=True)
class Link:
    """A stage file read by a later stage: from `source`'s card to `target`'s box."""

    source: str
    target: str
    start: tuple[float, float]
    end: tuple[float, float]
    ran: bool


@dataclass(frozen=True)
class Layout:
    cards: tuple[Card, ...]
    links: tuple[Link, ...]
    width: float
    height: float


def records(workdir: str | Path, settings: Mapping[str, Mapping[str, Any]]) -> dict[str, dict | str]:
    """Each stage's JSON record as `stages.status` checked it against its `settings` (twin,
    fingerprint, checksum, header), or the reason it is not done (a string)."""
    from tpupedia.pipelines import stages

    out: dict[str, dict | str] = {}
    for stage, wanted in settings.items():
        keep: dict = {}
        reason = stages.status(workdir, stage, wanted, keep=keep)
        out[stage] = keep[stage][1] if reason is None else reason
    return out


def _card_lines(stage: str, record: dict | str | None) -> tuple[str, ...]:
    name = (f"{stage}.safetensors", f"+ {stage}.json (its record)")
    if record is None:
        why = "only with a picture" if stage == "image" else "only for some requests"
        return (*name, "not written: this request", "does not run this stage", f"(it runs {why})")
    if isinstance(record, str):
        return (*name, "not done:", record[:34] + ("..." if len(record) > 34 else ""))
    lines = list(name)
    for tensor, info in record["tensors"].items():
        lines += [f"{tensor}", f"    {tuple(info['shape'])} {info['dtype']}"]
    lines += [f"fingerprint {record['fingerprint']}", f"sha256 {record['sha256'][:12]}... checked"]
    return tuple(lines)


def layout(order: Sequence[str], inputs: Mapping[str, Sequence[str]], records: Mapping[str, dict | str]) -> Layout:
    """Where each stage of `order` and its file go, and which file each later stage reads.

    `order`: the pipeline's stages in order; `inputs`: the stages whose files each stage takes;
    `records`: the JSON record (or the reason it is missing) of each stage the request runs; a
    stage of `order` without one is the pipeline's but not this request's, drawn dashed. Stages
    go left to right by depth (a stage one column right of the latest it reads); stages of one
    depth stack, the first in `order` lowest."""
    depth: dict[str, int] = {}
    for stage in order:
        before = [depth[s] for s in inputs.get(stage, ()) if s in depth]
        depth[stage] = 1 + max(before) if before else 0
    rows = {s: sum(1 for t in order[:i] if depth[t] == depth[s]) for i, s in enumerate(order)}
    lines = {s: _card_lines(s, records.get(s)) for s in order}
    row_h = [0.0] * (1 + max(rows.values(), default=0))
    for s in order:
        row_h[rows[s]] = max(row_h[rows[s]], STAGE_H + WRITE_GAP + LINE * (len(lines[s]) + 1))
    footer, title = 1.2, 0.7
    bottoms = [footer + sum(row_h[:r]) + 0.35 * r for r in range(len(row_h))]
    cards = []
    for s in order:
        x = MARGIN + depth[s] * (COLUMN + GAP)
        card_h = LINE * (len(lines[s]) + 1)
        top = bottoms[rows[s]] + row_h[rows[s]]
        stage_y = top - STAGE_H
        cards.append(Card(s, s in records, x, stage_y, stage_y - WRITE_GAP - card_h, card_h, lines[s]))
    by_stage = {c.stage: c for c in cards}
    links = []
    for target in order:
        sources = [s for s in inputs.get(target, ()) if s in by_stage]
        box_ = by_stage[target]
        for k, source in enumerate(sources):
            c = by_stage[source]
            end_y = box_.stage_y + STAGE_H * (k + 1) / (len(sources) + 1)
            links.append(Link(source, target, (c.x + COLUMN, c.card_y + c.card_h / 2), (box_.x, end_y),
                              source in records and target in records))
    width = 2 * MARGIN + (max(depth.values()) + 1) * COLUMN + max(depth.values()) * GAP
    return Layout(tuple(cards), tuple(links), width, bottoms[-1] + row_h[-1] + title)


def draw(pipe: Any, request: Any, workdir: str | Path, *, title: str | None = None) -> Any:
    """The stages of `pipe`'s pipeline for `request` and the stage files its run wrote in
    `workdir`, each read and checked by the stage-file reader; returns the Figure."""
    from tpupedia.pipelines import common

    order = [s for s in common.STAGE_ORDER if s != "image" or getattr(pipe, "image_to_video", False)]
    runs = common.request_stages(request)
    plan = layout(order, common.STAGE_INPUTS, records(workdir, {s: pipe.settings(s, request) for s in runs}))
    fig, ax = canvas(plan.width, plan.height, inches_per_unit=min(0.8, 9.0 / plan.width))
    for c in plan.cards:
        style = {} if c.ran else {"linestyle": "--", "alpha": 0.6}
        fill = color(order.index(c.stage))
        box(ax, c.x, c.stage_y, COLUMN, STAGE_H, "", fill=fill, alpha=0.85 if c.ran else 0.25,
            **({} if c.ran else {"linestyle": "--"}))
        ax.text(c.x + COLUMN / 2, c.stage_y + STAGE_H / 2, f"{c.stage}:  pipe.{CALLS.get(c.stage, c.stage)}(...)",
                ha="center", va="center", fontsize=FONT, color=INK, weight="bold")
        box(ax, c.x, c.card_y, COLUMN, c.card_h, "", fill="white", edge=fill if c.ran else INK, **style)
        for k, line in enumerate(c.lines):
            ax.text(c.x + 0.12, c.card_y + c.card_h - LINE * (k + 0.9), line, ha="left", va="center",
                    fontsize=FONT, color=INK, weight="bold" if k == 0 else "normal")
        arrow(ax, (c.x + COLUMN / 2, c.stage_y), (c.x + COLUMN / 2, c.card_y + c.card_h),
              "writes" if c.ran else "", offset=(0.35, -0.12), style="-|>" if c.ran else "-")
    for link in plan.links:
        arrow(ax, link.start, link.end, "read" if link.ran else "", color=INK if link.ran else "#999999",
              offset=(0.0, 0.05))
    for k, line in enumerate(CHECKS):
        ax.text(MARGIN, 0.85 - 0.3 * k, line, ha="left", va="center", fontsize=FONT - 0.5, color=INK)
    ran = [c.stage for c in plan.cards if c.ran]
    ax.text(plan.width / 2, plan.height - 0.35,
            title or f"{len(ran)} stages of this request ({', '.join(ran)}), joined by the stage files its run wrote",
            ha="center", va="center", fontsize=FONT + 2, color=INK, weight="bold")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return fig
