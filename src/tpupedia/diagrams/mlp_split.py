"""An MLP split column-then-row (Megatron) over one mesh axis, and the collectives it compiles to.

Drawn from the real objects: the `NamedSharding`s of the input and of the MLP's two weights, in
torch's `(out, in)` layout (`fc1` of `(F, D)`, `fc2` of `(D, F)`), say which features each device
holds (`devices_indices_map`), and the collectives are those read from the compiled program
(`tpupedia.aot.collective_ops`). Each device position along the axis is one lane: it computes its
slice of the hidden features from the whole input, then a partial output from that slice; the
collectives add the partials up. `layout` computes what goes where (pure data, tested directly);
`draw` renders it. Introduced in notebook `sharding` (section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tpupedia.diagrams import FONT, INK, arrow, box, canvas, color

__all__ = ["Lane", "Layout", "layout", "draw"]


@dataclass(frozen=True)
class Lane:
    """One position along the split axis: the devices there and the features they hold."""

    index: int
    devices: tuple[int, ...]
    """Ids of the devices at this position (one per group of the other mesh axes)."""
    fc1_rows: tuple[int, int]
    """`(start, stop)` of `fc1`'s rows (output features: the hidden slice computed here)."""
    fc2_cols: tuple[int, int]
    """`(start, stop)` of `fc2`'s columns (input features: the hidden slice consumed here)."""


@dataclass(frozen=True)
class Layout:
    """What goes where in the picture."""

    axis: str
    x_shape: tuple[int, ...]
    x_block: tuple[int, ...]
    x_spec: str
    x_whole_on_axis: bool
    """True when `x`'s spec does not name the axis: every device along it has the same `x`."""
    fc1_shape: tuple[int, int]
    fc1_spec: str
    fc2_shape: tuple[int, int]
    fc2_spec: str
    fc2_split: int | None
    """The dimension of `fc2` its spec splits (1 for row-parallel), or None when it is replicated."""
    lanes: tuple[Lane, ...]
    collectives: tuple[tuple[str, int, int], ...]
    """`(kind, how many, devices per group)` of the compiled program's collectives, in program order."""

    @property
    def out_block(self) -> tuple[int, ...]:
        """One device's block of the output `x @ fc1.T @ fc2.T`."""
        return self.x_block[:-1] + (self.fc2_shape[0],)


def _spec_text(spec: Any) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _dim_range(sharding: Any, shape: tuple[int, ...], dim: int) -> dict[int, tuple[int, int]]:
    return {int(d.id): index[dim].indices(shape[dim])[:2] for d, index in sharding.devices_indices_map(shape).items()}


def layout(x_sharding: Any, x_shape: tuple[int, ...], fc1_sharding: Any, fc1_shape: tuple[int, int],
           fc2_sharding: Any, fc2_shape: tuple[int, int], ops: Sequence[Any]) -> Layout:
    """The lanes of an MLP `gelu(x @ fc1.T) @ fc2.T` under these shardings, and the counted `ops`
    (`CollectiveOp`s of its compiled program). `fc1` must be column-parallel: its dim 0 split."""
    spec1 = tuple(fc1_sharding.spec) + (None,) * (2 - len(fc1_sharding.spec))
    axis = _axes(spec1[0])
    if not axis:
        raise ValueError(f"fc1 {_spec_text(fc1_sharding.spec)} does not split dim 0 (its output features): "
                         "not column-parallel")
    rows1 = _dim_range(fc1_sharding, tuple(fc1_shape), 0)
    cols2 = _dim_range(fc2_sharding, tuple(fc2_shape), 1)
    lanes: dict[tuple[int, int], list[int]] = {}
    for device in (int(d.id) for d in fc1_sharding.mesh.devices.flat):
        lanes.setdefault(rows1[device], []).append(device)
    kinds: dict[tuple[str, int], int] = {}
    for op in ops:
        kinds[(op.kind, op.group_size)] = kinds.get((op.kind, op.group_size), 0) + 1
    x_axes = {a for e in x_sharding.spec for a in _axes(e)}
    return Layout(
        axis=" × ".join(axis), x_shape=tuple(x_shape), x_block=tuple(x_sharding.shard_shape(tuple(x_shape))),
        x_spec=_spec_text(x_sharding.spec), x_whole_on_axis=not (x_axes & set(axis)),
        fc1_shape=tuple(fc1_shape), fc1_spec=_spec_text(fc1_sharding.spec),
        fc2_shape=tuple(fc2_shape), fc2_spec=_spec_text(fc2_sharding.spec),
        fc2_split=next((i for i, e in enumerate(fc2_sharding.spec) if _axes(e)), None),
        lanes=tuple(Lane(i, tuple(devs), rows, cols2[devs[0]]) for i, (rows, devs) in enumerate(sorted(lanes.items()))),
        collectives=tuple((kind, n, size) for (kind, size), n in kinds.items()))


def _role(split_dim: int | None) -> str:
    if split_dim is None:
        return "replicated: whole on every device"
    return f"{'column' if split_dim == 0 else 'row'}-parallel: dim {split_dim} ({'out' if split_dim == 0 else 'in'}) split"


def draw(x: Any, fc1: Any, fc2: Any, ops: Sequence[Any], *, title: str | None = None) -> Any:
    """A matplotlib Figure of `gelu(x @ fc1.T) @ fc2.T` as the shardings of the arrays `x`, `fc1`,
    `fc2` split it, with the collectives `ops` counted in its compiled program."""
    lay = layout(x.sharding, tuple(x.shape), fc1.sharding, tuple(fc1.shape), fc2.sharding, tuple(fc2.shape), ops)
    n = len(lay.lanes)
    lane_h, lane_gap = 1.4, 0.25
    head, foot = 1.0, 1.0
    title_h = 0.7 if title else 0.0
    width, height = 20.4, title_h + head + n * lane_h + (n - 1) * lane_gap + foot
    fig, ax = canvas(width, height, inches_per_unit=8.8 / width)
    if title:
        ax.text(width / 2, height - 0.1, title, ha="center", va="top", fontsize=FONT + 2, weight="bold", color=INK)
    top = height - title_h - head  # top of the first lane
    bottom = top - n * lane_h - (n - 1) * lane_gap
    mid = (top + bottom) / 2
    xs = {"x": (0.1, 2.4), "fc1": (3.2, 5.1), "fc2": (9.1, 5.1), "comm": (15.0, 2.3), "y": (18.0, 2.3)}

    def header(col: str, *lines: str) -> None:
        x0, w = xs[col]
        ax.text(x0 + w / 2, top + 0.15, "\n".join(lines), ha="center", va="bottom", fontsize=FONT, color=INK,
                linespacing=1.3)

    hidden = lay.fc1_shape[0]
    header("x", f"x {lay.x_shape}", lay.x_spec)
    header("fc1", f"fc1 {lay.fc1_shape}, {lay.fc1_spec}", _role(0))
    header("fc2", f"fc2 {lay.fc2_shape}, {lay.fc2_spec}", _role(lay.fc2_split))

    x0, w = xs["x"]
    same = f"same x on all\n{n} {lay.axis} devices" if lay.x_whole_on_axis else f"x split over {lay.axis}"
    box(ax, x0, bottom, w, top - bottom, f"x\n{lay.x_block}\nper device\n\n{same}", fill="#f4f4f4")
    for lane in lay.lanes:
        y0 = top - (lane.index + 1) * lane_h - lane.index * lane_gap
        ym = y0 + lane_h / 2
        (a, b), (c, d) = lane.fc1_rows, lane.fc2_cols
        f1x, f1w = xs["fc1"]
        box(ax, f1x, y0, f1w, lane_h, fill=color(lane.index), alpha=0.45)
        who = f"{lay.axis} {lane.index} (device{'s' if len(lane.devices) > 1 else ''} {', '.join(map(str, lane.devices))})"
        ax.text(f1x + f1w / 2, y0 + lane_h - 0.3, who, ha="center", va="center", fontsize=FONT, weight="bold",
                color=INK)
        ax.text(f1x + f1w / 2, y0 + 0.5, f"h = gelu(x @ fc1[{a}:{b}].T)\n{lay.x_block[:-1] + (b - a,)}: "
                f"features {a}:{b}", ha="center", va="center", fontsize=FONT, color=INK, linespacing=1.2)
        f2x, f2w = xs["fc2"]
        box(ax, f2x, y0, f2w, lane_h, fill=color(lane.index), alpha=0.45)
        share = f"1/{hidden // (d - c)} of the sum" if (d - c) < hidden else "the whole sum"
        ax.text(f2x + f2w / 2, y0 + lane_h / 2, f"partial = h @ fc2[:, {c}:{d}].T\n{lay.out_block}: {share}",
                ha="center", va="center", fontsize=FONT, color=INK, linespacing=1.3)
        arrow(ax, (x0 + w, ym if lay.x_whole_on_axis else mid), (f1x, ym))
        arrow(ax, (f1x + f1w, ym), (f2x, ym))
        arrow(ax, (f2x + f2w, ym), (xs["comm"][0], ym))

    cx, cw = xs["comm"]
    if lay.collectives:
        text = "\n\n".join(f"{kind}\n× {count}\nover {size}\ndevices" for kind, count, size in lay.collectives)
    else:
        text = "no\ncollective"
    box(ax, cx, bottom, cw, top - bottom, text, fill="#fff3d6", weight="bold")
    yx, yw = xs["y"]
    box(ax, yx, mid - 1.0, yw, 2.0, f"y {lay.x_shape[:-1] + (lay.fc2_shape[0],)}\n\n{lay.out_block}\nper device", fill="#f4f4f4")
    arrow(ax, (cx + cw, mid), (yx, mid))
    notes = {"fc1": "no communication: every device\nhas all of x and whole fc1 rows",
             "fc2": f"each partial sums over {hidden // n}\nof the {hidden} hidden features",
             "comm": "counted in the\ncompiled HLO"}
    for col, note in notes.items():
        nx, nw = xs[col]
        ax.text(nx + nw / 2, bottom - 0.12, note, ha="center", va="top", fontsize=FONT, color=INK, linespacing=1.3)
    return fig
