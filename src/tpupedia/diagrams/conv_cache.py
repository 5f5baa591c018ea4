"""The causal conv cache across frame batches, drawn from the VAE's real batches and kernel.

A causal 3-D convolution of temporal kernel size `kernel_t` pads time on the left only, with
`kernel_t - 1` frames. The decoder of CogVideoX's VAE runs in frame batches
(`tpupedia.models.cogvideox_vae.frame_batches`): the first batch is padded with copies of frame
0, every later one with the last `kernel_t - 1` frames of the previous batch's padded input (the
cache each `CausalConv3d` hands back). `layout` says which frame each slot of each batch's padded
input holds, where the cache comes from and which input frames an output frame sees; `draw`
renders it from the real frame count, batch size and conv. Introduced in notebook
`cogvideox_vae_flax`, section 4.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tpupedia.diagrams import INK, arrow, box, canvas, color

__all__ = ["Row", "Layout", "layout", "kernel_t", "draw"]

PAD_FILL = "#e6e6e6"


@dataclasses.dataclass(frozen=True)
class Row:
    """One frame batch as its causal conv sees it: the padded input, one slot per frame.

    Slot `s` sits under column `first + s` of the time axis; a column left of 0 holds a copy
    of frame 0, so every slot lines up with the frame it holds, and a cached slot with the slot
    of the previous batch it was copied from."""

    batch: int
    start: int
    end: int
    first: int
    slots: tuple[int, ...]
    cached: bool

    @property
    def pad(self) -> tuple[int, ...]:
        """The frames the left padding holds (`kernel_t - 1` slots)."""
        return self.slots[: self.start - self.first]

    @property
    def cache(self) -> tuple[int, ...]:
        """What this batch hands the next: the last `kernel_t - 1` frames of its padded input."""
        k1 = self.start - self.first
        return self.slots[len(self.slots) - k1:] if k1 else ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every frame batch's padded input (`rows`, in batch order) for one causal conv."""

    num_frames: int
    kernel_t: int
    rows: tuple[Row, ...]

    def window(self, frame: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Output frame `frame`: the batch that computes it, the columns of the input slots its
        kernel covers, and the frames those slots hold."""
        row = next(r for r in self.rows if r.start <= frame < r.end)
        cols = tuple(range(frame - self.kernel_t + 1, frame + 1))
        return row.batch, cols, tuple(row.slots[c - row.first] for c in cols)


def layout(batches: Sequence[tuple[int, int]], kernel_t: int) -> Layout:
    """Which frame every slot of every frame batch's padded conv input holds.

    `batches` are the decoder's own `(start, end)` frame batches, in order and without gaps
    (the VAE's `frame_batches(num_frames, batch)`). Batch 0 is padded with `kernel_t - 1`
    copies of frame 0; batch i > 0 with batch i-1's cache, the last `kernel_t - 1` slots of its
    padded input (which, for a batch shorter than the kernel, still include padding)."""
    batches = [tuple(b) for b in batches]
    if not batches or kernel_t < 1 or batches[0][0] != 0 or any(
            e <= s or (i and s != batches[i - 1][1]) for i, (s, e) in enumerate(batches)):
        raise ValueError(f"need kernel_t >= 1 and batches that cover frames 0.. in order, got {batches}, {kernel_t}")
    k1 = kernel_t - 1
    rows: list[Row] = []
    for i, (start, end) in enumerate(batches):
        if i == 0:
            pad = (start,) * k1  # copies of frame 0
        else:
            pad = rows[-1].cache
        rows.append(Row(i, start, end, start - k1, pad + tuple(range(start, end)), cached=i > 0 and k1 > 0))
    return Layout(batches[-1][1], kernel_t, tuple(rows))


def kernel_t(conv: Any) -> int:
    """The temporal kernel size of a causal conv: the first axis of its (kT, kH, kW, I, O) kernel
    (`CausalConv3d.conv.kernel`, or `.kernel` on a conv that holds it directly)."""
    return int(getattr(conv, "conv", conv).kernel.shape[0])


def _range(a: int, b: int) -> str:
    return f"frame {a}" if a == b else f"frames {a}–{b}"


def draw(batches: Sequence[tuple[int, int]], conv: Any, *, focus: int | None = None, title: str | None = None):
    """The decoder's frame `batches` of latent frames, each batch's padded input to `conv`
    (a causal conv; its kernel's time extent sets the padding), the cache handed from batch to
    batch, and the input slots output frame `focus` sees (default: the first frame of the
    second batch, the first whose window reaches into a cache)."""
    from matplotlib.patches import Rectangle

    lay = layout(batches, kernel_t(conv))
    num_frames = lay.num_frames
    sizes = sorted({r.end - r.start for r in lay.rows})
    batch = "/".join(map(str, sizes))
    k1 = lay.kernel_t - 1
    if focus is None:
        focus = lay.rows[1].start if len(lay.rows) > 1 else num_frames - 1
    focus_batch, focus_cols, focus_frames = lay.window(focus)

    cell, bw, row_h = 1.0, 0.8, 1.5
    n_cols = num_frames + k1
    ipu = min(0.75, 5.6 / n_cols)  # inches per unit: 7.5 to 9 inches wide whatever the frame count
    label_w = 3.0 / ipu  # the row labels' width, in units: constant in inches, like the font
    width = label_w + n_cols * cell + 0.2 / ipu
    height = 0.5 + 0.9 + bw + len(lay.rows) * row_h + 1.6 + 0.2
    fig, ax = canvas(width, height, inches_per_unit=ipu)

    def x_of(col: int) -> float:
        return label_w + (col + k1) * cell + (cell - bw) / 2

    def batch_of(frame: int) -> int:
        return next(r.batch for r in lay.rows if r.start <= frame < r.end)

    def label(y: float, text: str) -> None:
        ax.text(label_w - 0.2, y + bw / 2, text, ha="right", va="center", fontsize=9, color=INK)

    y = height - 0.5
    ax.text(width / 2, y, title or (f"Causal conv, kernel_t = {lay.kernel_t}, over {num_frames} latent frames "
                                    f"in frame batches of {batch}"),
            ha="center", va="center", fontsize=10, weight="bold", color=INK)

    # the latent frames, coloured by the batch that carries them
    y -= 0.9 + bw
    label(y, "latent frames\n(colour = frame batch)")
    for f in range(num_frames):
        box(ax, x_of(f), y, bw, bw, str(f), fill=color(batch_of(f)), alpha=0.85)
    for r in lay.rows:
        x0, x1 = x_of(r.start), x_of(r.end - 1) + bw
        ax.plot([x0, x1], [y + bw + 0.12] * 2, color=color(r.batch), lw=2)
        ax.text((x0 + x1) / 2, y + bw + 0.18, f"batch {r.batch}", ha="center", va="bottom", fontsize=9,
                color=INK)

    # each batch's padded input, every slot under the column of the frame it holds
    row_y = {}
    for r in lay.rows:
        y -= row_h
        row_y[r.batch] = y
        if not k1:
            how = "nothing (kernel_t = 1)"
        elif r.batch == 0:
            how = f"{k1} cop{'y' if k1 == 1 else 'ies'} of frame 0"
        else:
            how = f"batch {r.batch - 1}'s cache"
        label(y, f"batch {r.batch} input ({_range(r.start, r.end - 1)}),\npadded with {how}")
        for s, frame in enumerate(r.slots):
            col = r.first + s
            if col >= r.start:  # the batch's own frames
                box(ax, x_of(col), y, bw, bw, str(frame), fill=color(r.batch), alpha=0.85)
            elif r.cached:  # padding copied from the previous batch: faded, dashed
                box(ax, x_of(col), y, bw, bw, str(frame), fill=color(batch_of(frame)) if col >= 0 else PAD_FILL,
                    alpha=0.4, linestyle="--")
            else:  # copies of frame 0
                box(ax, x_of(col), y, bw, bw, str(frame), fill=PAD_FILL, linestyle="--")
        if r.batch > 0 and k1:
            # the cache: the previous row's last k-1 slots, straight down into this row's padding
            for col in range(r.first, r.start):
                arrow(ax, (x_of(col) + bw / 2, row_y[r.batch - 1] - 0.04), (x_of(col) + bw / 2, y + bw + 0.04))
            what = f"cache: the last {k1} of batch 0's padded input" if r.batch == 1 else "cache"
            ax.text(x_of(r.first) - 0.15, y + bw + (row_h - bw) / 2, what,
                    ha="right", va="center", fontsize=9, color=INK)

    # which input slots one output frame sees: its kernel window, boxed, and an arrow to the output
    fy = row_y[focus_batch]
    x0, x1 = x_of(focus_cols[0]) - 0.08, x_of(focus_cols[-1]) + bw + 0.08
    ax.add_patch(Rectangle((x0, fy - 0.08), x1 - x0, bw + 0.16, fill=False, edgecolor=INK, linewidth=2.0))
    y -= 1.6
    seen = ", ".join(map(str, focus_frames))
    label(y, f"conv output\n(output {focus} sees frames {seen})")
    for f in range(num_frames):
        box(ax, x_of(f), y, bw, bw, str(f), fill=color(batch_of(f)), alpha=0.85 if f == focus else 0.25,
            weight="bold" if f == focus else "normal")
    arrow(ax, (x_of(focus) + bw / 2, fy - 0.08), (x_of(focus) + bw / 2, y + bw + 0.04))
    ax.text(x_of(focus) + bw / 2 - 0.15, (fy - 0.08 + y + bw) / 2, f"kernel window of output {focus}", ha="right",
            va="center", fontsize=9, color=INK)
    return fig
