"""Online softmax over key blocks, drawn from a real query row and the real keys.

One query's scores against `k`, cut into the key blocks a flash-style kernel reads one at a
time. `layout` runs the online-softmax loop with NumPy and records, per block, the scores, the
running max `m` before and after, the rescale factor `exp(m_old - m_new)` that the running sum
`l` and the accumulator `o` are multiplied by, and `l` after the block; it also computes the
final weights `exp(s - m) / l` and the full softmax they equal. `draw` renders it: the scores
with the running max on top, the running sum block by block (what was kept, what the rescale
removed, what the block added) below, and the final weights against the full softmax at the
bottom. Introduced in notebook `splash_attention`, section 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tpupedia.diagrams import FONT, INK, color

__all__ = ["Step", "Layout", "layout", "draw"]

KEPT_FILL = "#bab0ac"


@dataclasses.dataclass(frozen=True)
class Step:
    """What one key block does to the running values of one query."""

    block: int
    start: int  # first key of the block
    stop: int  # one past its last key
    scores: np.ndarray  # the block's scores, q·k * scale
    m_old: float  # running max before the block (-inf before the first)
    m_new: float  # running max after it
    rescale: float  # exp(m_old - m_new): what l and o are multiplied by (0 for the first block)
    l_old: float  # running sum of exp(s - m_old) before the block
    added: float  # the block's own sum of exp(s - m_new)
    l_new: float  # l_old * rescale + added

    @property
    def raised(self) -> bool:
        """Whether this block raised the running max (so `rescale < 1`)."""
        return bool(self.m_new > self.m_old)


@dataclasses.dataclass(frozen=True)
class Layout:
    scores: np.ndarray  # every score of the query, in key order
    block: int
    steps: tuple[Step, ...]
    weights: np.ndarray  # exp(s - m) / l with the final m and l: what one pass gives
    softmax: np.ndarray  # the full softmax of `scores`, computed directly
    output: np.ndarray | None  # o / l, when values were given
    reference: np.ndarray | None  # softmax @ v, when values were given


def layout(q_row: Any, k: Any, block: int, scale: float = 1.0, v: Any = None) -> Layout:
    """Online softmax of one query row `q_row` (D,) over the keys `k` (S, D) in blocks of `block`
    keys (the last block may be shorter), scores `q·k * scale`; with values `v` (S, Dv) the
    accumulator `o` too. The same loop as notebook `splash_attention`'s `online_softmax_attention`,
    for one row, keeping every intermediate value."""
    q_row, k = np.asarray(q_row, np.float32), np.asarray(k, np.float32)
    if q_row.ndim != 1 or k.ndim != 2 or k.shape[1] != q_row.shape[0]:
        raise ValueError(f"need q_row (D,) and k (S, D), got {q_row.shape} and {k.shape}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    vals = None if v is None else np.asarray(v, np.float32)
    m, l = np.float32(-np.inf), np.float32(0.0)
    o = None if vals is None else np.zeros(vals.shape[1], np.float32)
    steps, parts = [], []
    for i, j in enumerate(range(0, k.shape[0], block)):
        s = (k[j : j + block] @ q_row) * np.float32(scale)
        m_new = np.maximum(m, s.max())
        rescale = np.exp(m - m_new)  # exp(-inf) = 0: nothing accumulated before the first block
        p = np.exp(s - m_new)
        l_new = l * rescale + p.sum()
        if o is not None:
            o = o * rescale + p @ vals[j : j + block]
        steps.append(Step(i, j, j + len(s), s, float(m), float(m_new), float(rescale), float(l), float(p.sum()),
                          float(l_new)))
        parts.append(s)
        m, l = m_new, l_new
    scores = np.concatenate(parts)
    weights = np.exp(scores - m) / l
    e = np.exp(scores - scores.max())
    softmax = e / e.sum()
    output = None if o is None else o / l
    reference = None if vals is None else softmax @ vals
    return Layout(scores, block, tuple(steps), weights, softmax, output, reference)


def _num(x: float) -> str:
    return "−∞" if x == -np.inf else f"{x:.2f}"


def draw(q_row: Any, k: Any, block: int, scale: float = 1.0, v: Any = None, *, title: str | None = None):
    """The online softmax of `q_row` over `k` in blocks of `block` keys (see `layout`): scores and
    running max, the running sum's rescale-and-add per block, and the final weights against the
    full softmax."""
    import matplotlib.pyplot as plt

    lay = layout(q_row, k, block, scale, v)
    n = len(lay.scores)
    keys = np.arange(n)
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(8.5, 7.6), sharex=True,
                                           gridspec_kw=dict(height_ratios=[3.2, 3.0, 2.2], hspace=0.5))
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.07)
    fig.suptitle(title or f"Online softmax of one query over {len(lay.steps)} key blocks of {lay.block}",
                 fontsize=10, weight="bold", color=INK)

    # top: the scores, block by block, and the running max m after each block
    lo, hi = float(lay.scores.min()), float(lay.scores.max())
    pad = 0.35 * (hi - lo)
    for st in lay.steps:
        x = np.arange(st.start, st.stop)
        top.vlines(x, lo - pad, st.scores, color=color(st.block), lw=1.0, alpha=0.55)
        top.hlines(st.m_new, st.start - 0.5, st.stop - 0.5, color=INK, lw=2.0)
        peak = st.start + int(np.argmax(st.scores))
        top.plot(peak, st.scores.max(), "o", ms=5, mfc=color(st.block) if st.raised else "white",
                 mec=INK, zorder=3)
        top.text((st.start + st.stop) / 2, st.m_new + 0.06 * (hi - lo),
                 f"m = {_num(st.m_new)}" + ("" if st.raised or st.block == 0 else "\n(unchanged)"),
                 ha="center", va="bottom", fontsize=FONT, color=INK)
        top.text((st.start + st.stop) / 2, lo - pad * 0.85, f"block {st.block}: keys {st.start}–{st.stop - 1}",
                 ha="center", va="bottom", fontsize=FONT, color=INK,
                 bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=color(st.block), lw=1.0))
        if st.block:
            top.vlines(st.start, st.m_old, st.m_new, color=INK, lw=2.0)
    top.set_ylim(lo - pad, hi + 0.75 * pad)
    top.set_ylabel("score q·k · scale", fontsize=FONT)
    top.set_title("scores (one line per key) and the running max m (black); a filled dot is a block max "
                  "that raised m", fontsize=FONT, color=INK)

    # middle: the running sum l, per block: kept (l_old * rescale) + added = l_new
    from matplotlib.patches import Patch

    width = 0.62 * lay.block
    top_l = max(max(st.l_new, st.l_old) for st in lay.steps)
    for st in lay.steps:
        c = (st.start + st.stop) / 2
        kept = st.l_old * st.rescale
        mid.bar(c, kept, width, color=KEPT_FILL, edgecolor=INK, lw=0.8)
        mid.bar(c, st.added, width, bottom=kept, color=color(st.block), edgecolor=INK, lw=0.8, alpha=0.8)
        if st.block:
            mid.bar(c, st.l_old, width, bottom=0, color="none", edgecolor=INK, ls="--", lw=1.2, zorder=3)
        label = ("m: −∞ → " + _num(st.m_new) + "\nc = exp(−∞) = 0" if st.block == 0 else
                 f"m: {_num(st.m_old)} → {_num(st.m_new)}\nc = {st.rescale:.3f}")
        mid.text(c, max(st.l_new, st.l_old) + 0.04 * top_l,
                 f"{label}\nl = {st.l_old:.1f}·c + {st.added:.1f} = {st.l_new:.1f}",
                 ha="center", va="bottom", fontsize=FONT, color=INK)
    mid.set_ylim(0, top_l * 2.1)
    mid.set_ylabel("running sum l", fontsize=FONT)
    mid.set_title("per block: l and o are multiplied by c = exp(m_old − m_new), then the block's "
                  "Σ exp(s − m_new) is added to l", fontsize=FONT, color=INK)
    mid.legend(handles=[Patch(fc="none", ec=INK, ls="--", label="l before the block"),
                        Patch(fc=KEPT_FILL, ec=INK, label="l·c: kept, now measured against the new m"),
                        Patch(fc="white", ec=INK, hatch="////", label="added by the block (block colour)")],
               fontsize=FONT, loc="upper left", frameon=False, ncol=3, handlelength=1.6, columnspacing=1.2)

    # bottom: the final weights exp(s - m) / l against the full softmax
    for st in lay.steps:
        x = np.arange(st.start, st.stop)
        bottom.vlines(x, 0, lay.weights[st.start:st.stop], color=color(st.block), lw=1.2)
    bottom.plot(keys, lay.softmax, ".", ms=2.5, color=INK, label="full softmax, all scores at once")
    diff = float(np.abs(lay.weights - lay.softmax).max())
    bottom.set_title(f"after the last block: exp(s − m) / l (lines) equals the full softmax (dots), "
                     f"max |diff| {f'{diff:.1e}' if diff else 0}", fontsize=FONT, color=INK)
    bottom.set_ylabel("weight", fontsize=FONT)
    bottom.set_xlabel("key", fontsize=FONT)
    bottom.set_ylim(0, float(lay.softmax.max()) * 1.25)
    bottom.legend(fontsize=FONT, loc="upper left", frameon=False)
    for ax in (top, mid, bottom):
        ax.tick_params(labelsize=FONT)
        ax.set_xlim(-0.5, n - 0.5)
        for st in lay.steps[1:]:
            ax.axvline(st.start - 0.5, color=INK, lw=0.6, ls=":")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    plt.close(fig)
    return fig
