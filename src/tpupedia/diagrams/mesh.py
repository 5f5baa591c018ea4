"""A device mesh, and which block of an array each device holds under a `NamedSharding`.

Drawn from the real objects: the `Mesh` gives the grid of device ids and the axis names and sizes,
and the sharding's own `devices_indices_map(shape)` says which block of the array each device
holds. `layout` computes that (pure data, tested directly); `draw` renders it. Devices that hold
the same block share a colour, so an axis the `PartitionSpec` does not name shows up as the same
block on several devices. Introduced in notebook `sharding` (section 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tpupedia.diagrams import FONT, INK, arrow, box, canvas, color

__all__ = ["Block", "Layout", "layout", "draw"]


@dataclass(frozen=True)
class Block:
    """One distinct block of the array and the devices that hold it."""

    bounds: tuple[tuple[int, int], ...]
    """`(start, stop)` along each array dimension."""
    devices: tuple[int, ...]
    """Ids of the devices holding this block, in the mesh's order."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.bounds)


@dataclass(frozen=True)
class Layout:
    """What goes where: the mesh's grid of device ids and the array's blocks."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    """Device ids as the mesh arranges them: rows over all axes but the last, columns over the last."""
    shape: tuple[int, ...]
    spec: str
    blocks: tuple[Block, ...]
    """The distinct blocks, in the order the grid first meets them (row by row); block `i` is drawn in `color(i)`."""
    replicated_over: tuple[str, ...]
    """Mesh axes (of size > 1) the spec does not name: each block is copied along them."""

    def block_of(self, device: int) -> int:
        """The number of the block device id `device` holds."""
        return next(i for i, b in enumerate(self.blocks) if device in b.devices)


def _spec_text(spec: Any) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _named_axes(spec: Any) -> set[str]:
    return {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}


def layout(mesh: Any, sharding: Any, shape: tuple[int, ...]) -> Layout:
    """Where each block of an array of `shape` lives under `sharding`, a `NamedSharding` on `mesh`."""
    if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names) or \
            [d.id for d in sharding.mesh.devices.flat] != [d.id for d in mesh.devices.flat]:
        raise ValueError(f"the sharding's mesh {dict(sharding.mesh.shape)} is not the mesh drawn, {dict(mesh.shape)}")
    ids = mesh.devices
    rows = ids.reshape(1, -1) if ids.ndim == 1 else ids.reshape(-1, ids.shape[-1])
    grid = tuple(tuple(int(d.id) for d in row) for row in rows)
    where = {int(d.id): tuple(s.indices(n)[:2] for s, n in zip(index, shape))
             for d, index in sharding.devices_indices_map(tuple(shape)).items()}
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device in (d for row in grid for d in row):
        holders.setdefault(where[device], []).append(device)
    named = _named_axes(sharding.spec)
    return Layout(axis_names=tuple(mesh.axis_names), axis_sizes=tuple(int(mesh.shape[a]) for a in mesh.axis_names),
                  grid=grid, shape=tuple(shape), spec=_spec_text(sharding.spec),
                  blocks=tuple(Block(bounds, tuple(devs)) for bounds, devs in holders.items()),
                  replicated_over=tuple(a for a in mesh.axis_names if a not in named and mesh.shape[a] > 1))


def _ranges(block: Block) -> str:
    names = ("rows", "cols") if len(block.bounds) == 2 else ("elements",)
    return "\n".join(f"{n} {a}:{b}" for n, (a, b) in zip(names, block.bounds))


def _devices_text(devices: tuple[int, ...]) -> str:
    return ("dev " if len(devices) == 1 else "devs ") + ", ".join(map(str, devices))


# Drawing units: one mesh cell, the gap between the grid and the array, the array's longer side.
_CELL_W, _CELL_H, _GAP, _ARRAY = 1.5, 1.0, 1.6, 3.2


def _row_height(lay: Layout) -> float:
    rows, cols = (lay.shape if len(lay.shape) == 2 else (1, lay.shape[0]))
    array_h = _ARRAY * rows / max(rows, cols)
    return max(len(lay.grid) * _CELL_H + 1.1, array_h) + 1.5


def _draw_row(ax: Any, lay: Layout, name: str, top: float) -> None:
    """One array: the mesh grid coloured by block on the left, the array cut into blocks on the right."""
    n_rows, n_cols = len(lay.grid), len(lay.grid[0])
    row_name = lay.axis_names[0] if len(lay.axis_names) == 2 else None
    col_name = lay.axis_names[-1]
    x0 = 0.9
    grid_top = top - 0.95
    # the heading of the row: the array, its spec and its per-device block
    shard = lay.blocks[0].shape
    ax.text(0.05, top - 0.2, f"{name}: shape {lay.shape}, {lay.spec}, {shard} per device", fontsize=FONT + 1,
            ha="left", va="top", color=INK, weight="bold")
    for c in range(n_cols):
        ax.text(x0 + (c + 0.5) * _CELL_W, grid_top + 0.08, f"{col_name} {c}", ha="center", va="bottom",
                fontsize=FONT, color=INK)
    for r in range(n_rows):
        y = grid_top - (r + 1) * _CELL_H
        if row_name is not None:
            ax.text(x0 - 0.1, y + _CELL_H / 2, f"{row_name} {r}", ha="right", va="center", fontsize=FONT, color=INK)
        for c, device in enumerate(lay.grid[r]):
            block = lay.blocks[lay.block_of(device)]
            box(ax, x0 + c * _CELL_W + 0.04, y + 0.04, _CELL_W - 0.08, _CELL_H - 0.08, fill=color(lay.block_of(device)),
                alpha=0.55)
            ax.text(x0 + (c + 0.5) * _CELL_W, y + _CELL_H - 0.2, f"device {device}", ha="center", va="center",
                    fontsize=FONT, weight="bold", color=INK)
            ax.text(x0 + (c + 0.5) * _CELL_W, y + 0.36, _ranges(block), ha="center", va="center",
                    fontsize=FONT - 1, color=INK, linespacing=1.1)
    sizes = " × ".join(f"{a} = {s}" for a, s in zip(lay.axis_names, lay.axis_sizes))
    grid_bottom = grid_top - n_rows * _CELL_H
    ax.text(x0 + n_cols * _CELL_W / 2, grid_bottom - 0.1, f"mesh {sizes}, each device in its block's colour\n"
            + _note(lay), ha="center", va="top", fontsize=FONT, color=INK, linespacing=1.3)
    # the array, cut into its blocks, each labelled with the devices that hold it
    rows, cols = (lay.shape if len(lay.shape) == 2 else (1, lay.shape[0]))
    unit = _ARRAY / max(rows, cols)
    ax0 = x0 + n_cols * _CELL_W + _GAP
    a_top = grid_top
    for i, block in enumerate(lay.blocks):
        (r0, r1), (c0, c1) = block.bounds if len(block.bounds) == 2 else ((0, 1), block.bounds[0])
        box(ax, ax0 + c0 * unit, a_top - r1 * unit, (c1 - c0) * unit, (r1 - r0) * unit, fill=color(i), alpha=0.55)
        text = "\n".join(f"dev {d}" for d in block.devices) if (r1 - r0) * unit >= 0.35 * len(block.devices) \
            else _devices_text(block.devices)
        ax.text(ax0 + (c0 + c1) / 2 * unit, a_top - (r0 + r1) / 2 * unit, text, ha="center", va="center",
                fontsize=FONT, color=INK, linespacing=1.15)
    ax.text(ax0 + cols * unit / 2, a_top + 0.08, f"the array {lay.shape}", ha="center", va="bottom", fontsize=FONT,
            color=INK)
    arrow(ax, (x0 + n_cols * _CELL_W + 0.15, grid_top - n_rows * _CELL_H / 2),
          (ax0 - 0.15, grid_top - n_rows * _CELL_H / 2), "holds", offset=(0, 0.06))


def _note(lay: Layout) -> str:
    """What the colours say: one block per device, or which devices share a block."""
    if not lay.replicated_over:
        return f"every mesh axis is named: {len(lay.blocks)} distinct blocks, one per device"
    shared = ", ".join(" & ".join(map(str, b.devices)) for b in lay.blocks[:4]) + (", ..." if len(lay.blocks) > 4 else "")
    axes = ", ".join(repr(a) for a in lay.replicated_over)
    return f"{lay.spec} names no {axes}: replicated over it,\nthe same block on devices {shared}"


def draw(mesh: Any, arrays: Any | Mapping[str, Any], *, title: str | None = None) -> Any:
    """A matplotlib Figure: `mesh` as a grid of device ids and, for each array (a `jax.Array` with a
    `NamedSharding` on `mesh`, or a mapping of names to such arrays), the block of it each device
    holds. Arrays of one or two dimensions."""
    named = dict(arrays) if isinstance(arrays, Mapping) else {"array": arrays}
    lays = {name: layout(mesh, a.sharding, tuple(a.shape)) for name, a in named.items()}
    for name, lay in lays.items():
        if len(lay.shape) not in (1, 2):
            raise ValueError(f"{name}: draw shows arrays of one or two dimensions, not {lay.shape}")
    n_cols = len(next(iter(lays.values())).grid[0])
    width = 0.9 + n_cols * _CELL_W + _GAP + _ARRAY + 1.0
    heights = [_row_height(lay) for lay in lays.values()]
    height = sum(heights) + (0.6 if title else 0.0)
    fig, ax = canvas(width, height, inches_per_unit=min(0.85, 8.5 / width))
    top = height
    if title:
        ax.text(width / 2, top - 0.1, title, ha="center", va="top", fontsize=FONT + 2, weight="bold", color=INK)
        top -= 0.6
    for (name, lay), h in zip(lays.items(), heights):
        _draw_row(ax, lay, name, top)
        top -= h
    return fig
