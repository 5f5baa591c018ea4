"""The hosts diagram (`tpupedia.diagrams.hosts`) is driven by the mesh's devices: their place in
the mesh, their `process_index` and their `coords` decide where each chip is drawn and which axis
is said to cross hosts."""

from types import SimpleNamespace

import matplotlib
import numpy as np

matplotlib.use("Agg")

from tpupedia.diagrams import hosts


def chip(i, process, coords=None):
    d = SimpleNamespace(id=i, process_index=process)
    if coords is not None:
        d.coords = coords
    return d


def two_hosts(rows_are_hosts: bool):
    """8 chips on 2 hosts of 2x2 chips, as a (dp=2, tp=4) mesh: each dp row one host, or each
    tp group split over both hosts."""
    devs = [chip(i, i // 4, [i % 2 + 2 * (i // 4), (i % 4) // 2, 0]) for i in range(8)]
    order = [0, 1, 2, 3, 4, 5, 6, 7] if rows_are_hosts else [0, 1, 4, 5, 2, 3, 6, 7]
    return SimpleNamespace(devices=np.array([devs[i] for i in order]).reshape(2, 4), axis_names=("dp", "tp"))


def test_which_axis_crosses_hosts_follows_process_index():
    inside = {a.name: a for a in hosts.layout(two_hosts(True)).axes}
    assert not inside["tp"].crosses_hosts and inside["tp"].hosts_per_group == 1
    assert inside["dp"].crosses_hosts and inside["dp"].hosts_per_group == 2
    across = {a.name: a for a in hosts.layout(two_hosts(False)).axes}
    assert across["tp"].crosses_hosts and across["tp"].hosts_per_group == 2
    assert across["dp"].hosts_per_group == 1


def test_chips_sit_in_their_host_box_at_their_mesh_index():
    plan = hosts.layout(two_hosts(False))
    assert sorted(plan.hosts) == [0, 1] and len(plan.chips) == 8
    for c in plan.chips:
        x, y, w, h = plan.hosts[c.process]
        assert x <= c.host_xy[0] < x + w and y <= c.host_xy[1] < y + h
    by_id = {c.id: c for c in plan.chips}
    assert by_id[4].index == (0, 2) and by_id[4].process == 1  # chip 4 holds tp 2 of dp 0, on host 1
    assert by_id[4].mesh_xy[0] > by_id[1].mesh_xy[0]  # tp runs left to right in the upper panel
    assert by_id[0].mesh_xy[1] > by_id[2].mesh_xy[1]  # dp 0 above dp 1
    # coords decide the place inside a host: chip 1 is right of chip 0, chip 2 below it
    assert by_id[1].host_xy[0] > by_id[0].host_xy[0] and by_id[2].host_xy[1] < by_id[0].host_xy[1]


def test_devices_without_coords_line_up_by_id():
    devs = np.array([chip(i, i // 2) for i in range(4)]).reshape(1, 4)
    plan = hosts.layout(SimpleNamespace(devices=devs, axis_names=("dp", "tp")))
    by_id = {c.id: c for c in plan.chips}
    assert by_id[0].host_xy[1] == by_id[1].host_xy[1] and by_id[1].host_xy[0] > by_id[0].host_xy[0]
    assert plan.slices == 1 and [a.hosts_per_group for a in plan.axes] == [1, 2]


def test_draw_writes_what_layout_found():
    fig = hosts.draw(two_hosts(True))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "tp (4 chips a group): each group spans 1 host(s): its collectives stay inside one host" in texts
    assert "host 1 (process_index 1)" in texts and "1,3" in texts  # chip 7: dp 1, tp 3
    assert any(t.startswith("8 chips, 2 hosts") for t in texts)
