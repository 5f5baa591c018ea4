"""Processes, hosts and chips in one mesh, drawn from the mesh's devices: where each chip sits in
the mesh's axes (`mesh.devices`, `mesh.axis_names`), which process (host) drives it
(`process_index`) and, where the devices expose them, its coordinates in the slice (`coords`).
From those alone it finds which mesh axis stays inside one host and which crosses hosts.

`layout(mesh)` says what goes where (pure: tested with a fake device list); `draw(mesh)` renders
it. Introduced in notebook `beyond_one_host` (section 4, one video on a bigger slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from tpupedia.diagrams import FONT, INK, box, canvas, color

__all__ = ["Chip", "Axis", "Layout", "layout", "draw"]

CELL, HOST_GAP, PAD = 1.0, 0.5, 0.15  # a chip's square, the space between hosts, a host box's margin


@dataclass(frozen=True)
class Chip:
    """One device: its id, its process, its index in the mesh, and where the two panels draw it."""

    id: int
    process: int
    index: tuple[int, ...]  # position along each mesh axis
    mesh_xy: tuple[float, float]  # lower-left corner in the upper panel (the mesh as the program sees it)
    host_xy: tuple[float, float]  # lower-left corner in the lower panel (grouped by host)


@dataclass(frozen=True)
class Axis:
    """A mesh axis: its size and how many hosts one of its groups spans (1: inside one host)."""

    name: str
    size: int
    hosts_per_group: int

    @property
    def crosses_hosts(self) -> bool:
        return self.hosts_per_group > 1


@dataclass(frozen=True)
class Layout:
    chips: tuple[Chip, ...]
    axes: tuple[Axis, ...]
    hosts: dict[int, tuple[float, float, float, float]]  # process -> its box (x, y, w, h) in the lower panel
    rows: int  # the upper panel's rows (every axis but the last) and columns (the last axis)
    columns: int
    width: float
    height: float
    mesh_top: float  # the upper panel's top edge (its column labels sit above it)
    slices: int  # how many slices the devices are in (`slice_index`; 1 when they do not say)


def _groups(devices: np.ndarray, axis: int) -> list[list[Any]]:
    """The devices of each group along `axis` (the others fixed)."""
    moved = np.moveaxis(devices, axis, -1)
    return [list(row) for row in moved.reshape(-1, moved.shape[-1])]


def layout(mesh: Any) -> Layout:
    """Where each of `mesh.devices` goes: the upper panel is the mesh as the program indexes it
    (the last axis across, the others down); the lower one groups the chips by
    `process_index`, hosts left to right, each host's chips at their `coords` within it where
    the devices have coords, else in a row. Also each axis's hosts per group."""
    devices = np.asarray(mesh.devices)
    names = tuple(mesh.axis_names)
    columns = devices.shape[-1]
    rows = int(np.prod(devices.shape[:-1], dtype=int))
    axes = tuple(Axis(n, devices.shape[i], max(len({d.process_index for d in g}) for g in _groups(devices, i)))
                 for i, n in enumerate(names))
    by_host: dict[int, list[tuple[tuple[int, ...], Any]]] = {}
    for index in product(*(range(n) for n in devices.shape)):
        d = devices[index]
        by_host.setdefault(int(d.process_index), []).append((index, d))
    spots: dict[int, tuple[int, int]] = {}  # device id -> (column, row) inside its host
    host_size: dict[int, tuple[int, int]] = {}
    for process, members in by_host.items():
        coords = [getattr(d, "coords", None) for _, d in members]
        if all(c is not None and len(c) >= 2 for c in coords):
            x0, y0 = min(c[0] for c in coords), min(c[1] for c in coords)
            for (_, d), c in zip(members, coords):
                spots[d.id] = (c[0] - x0, c[1] - y0)
        else:
            for k, (_, d) in enumerate(sorted(members, key=lambda m: m[1].id)):
                spots[d.id] = (k, 0)
        host_size[process] = (1 + max(spots[d.id][0] for _, d in members), 1 + max(spots[d.id][1] for _, d in members))
    hosts_h = max(h for _, h in host_size.values()) * CELL + 2 * PAD
    footer, label, gap, title, header = 0.45 + 0.3 * len(names), 0.45, 0.9, 0.8, 0.45
    hosts_y = footer + label
    mesh_y = hosts_y + hosts_h + gap
    left = 1.1  # room for the row labels
    hosts: dict[int, tuple[float, float, float, float]] = {}
    x = 0.2
    for process in sorted(by_host):
        w, h = host_size[process]
        hosts[process] = (x, hosts_y, w * CELL + 2 * PAD, hosts_h)
        x += w * CELL + 2 * PAD + HOST_GAP
    chips = []
    for process in sorted(by_host):
        hx, hy, _, hh = hosts[process]
        for index, d in by_host[process]:
            col, row = spots[d.id]
            flat_row = int(np.ravel_multi_index(index[:-1], devices.shape[:-1])) if devices.ndim > 1 else 0
            chips.append(Chip(int(d.id), process, tuple(int(i) for i in index),
                              (left + index[-1] * CELL, mesh_y + (rows - 1 - flat_row) * CELL),
                              (hx + PAD + col * CELL, hy + hh - PAD - (row + 1) * CELL)))
    width = max(x - HOST_GAP + 0.2, left + columns * CELL + 0.2)
    mesh_top = mesh_y + rows * CELL
    slices = len({getattr(d, "slice_index", 0) for d in devices.flat})
    return Layout(tuple(chips), axes, hosts, rows, columns, width, mesh_top + header + title, mesh_top, slices)


def draw(mesh: Any, *, title: str | None = None) -> Any:
    """`mesh`'s chips twice: as the program indexes them (the mesh's axes) and grouped by the
    process (host) that drives them, coloured by host; returns the Figure."""
    import matplotlib.pyplot as plt

    plan = layout(mesh)
    fig, ax = canvas(plan.width, plan.height, inches_per_unit=min(0.8, 9.0 / plan.width))
    names = [a.name for a in plan.axes]
    processes = sorted(plan.hosts)
    fill = {p: color(i) for i, p in enumerate(processes)}
    for c in plan.chips:
        box(ax, *c.mesh_xy, CELL * 0.92, CELL * 0.92, str(c.id), fill=fill[c.process], alpha=0.75)
        box(ax, *c.host_xy, CELL * 0.92, CELL * 0.92, "", fill=fill[c.process], alpha=0.75)
        ax.text(c.host_xy[0] + CELL * 0.46, c.host_xy[1] + CELL * 0.62, str(c.id), ha="center", va="center",
                fontsize=FONT, color=INK, weight="bold")
        ax.text(c.host_xy[0] + CELL * 0.46, c.host_xy[1] + CELL * 0.28, ",".join(map(str, c.index)), ha="center",
                va="center", fontsize=FONT - 1, color=INK)
    mesh_y = plan.mesh_top - plan.rows * CELL
    last = plan.axes[-1]
    for j in range(plan.columns):
        ax.text(1.1 + (j + 0.46) * CELL, plan.mesh_top + 0.15, f"{last.name} {j}", ha="center", va="bottom",
                fontsize=FONT, color=INK)
    outer = [a.size for a in plan.axes[:-1]]
    for r, index in enumerate(product(*(range(n) for n in outer))):
        text = " ".join(f"{a.name} {i}" for a, i in zip(plan.axes, index))
        ax.text(1.0, mesh_y + (plan.rows - 1 - r + 0.46) * CELL, text, ha="right", va="center", fontsize=FONT,
                color=INK)
    for p, (x, y, w, h) in plan.hosts.items():
        box(ax, x, y, w, h, "", fill="none", edge=INK)
        ax.text(x + w / 2, y - 0.1, f"host {p} (process_index {p})", ha="center", va="top", fontsize=FONT,
                color=INK)
    ax.text(plan.width / 2, mesh_y - 0.25,
            f"the same chips grouped by host; each chip: its id, then its index ({','.join(names)}) in the mesh",
            ha="center", va="top", fontsize=FONT, color=INK, style="italic")
    lines = [f"{a.name} ({a.size} chips a group): each group spans {a.hosts_per_group} host(s): "
             + ("its collectives cross hosts" if a.crosses_hosts else "its collectives stay inside one host")
             for a in plan.axes]
    lines.append("Chips of one slice reach each other over ICI, across hosts too; only separate slices talk over DCN."
                 if plan.slices == 1 else f"These chips are in {plan.slices} slices: between slices, over DCN.")
    for k, line in enumerate(lines):
        ax.text(0.2, 0.25 + 0.3 * (len(lines) - 1 - k), line, ha="left", va="center", fontsize=FONT, color=INK)
    ax.text(plan.width / 2, plan.height - 0.35,
            title or f"{len(plan.chips)} chips, {len(plan.hosts)} hosts: the mesh "
            f"{dict(zip(names, (a.size for a in plan.axes)))} as the program sees it",
            ha="center", va="center", fontsize=FONT + 2, color=INK, weight="bold")
    plt.close(fig)
    return fig
