"""The mesh diagram is driven by the real `Mesh` and `NamedSharding`: change the spec or the mesh
and which device holds which block changes, in `layout` and in the drawing."""

import jax
import matplotlib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import devices
from tpupedia.diagrams import mesh as mesh_diagram

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def mesh():
    return devices.make_mesh((2, 4), ("dp", "tp"))


def texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_every_axis_named_gives_one_block_per_device(mesh):
    lay = mesh_diagram.layout(mesh, NamedSharding(mesh, P("dp", "tp")), (8, 8))
    assert lay.axis_names == ("dp", "tp") and lay.axis_sizes == (2, 4)
    assert lay.grid == tuple(tuple(int(d.id) for d in row) for row in mesh.devices)
    assert len(lay.blocks) == 8 and all(len(b.devices) == 1 for b in lay.blocks)
    assert {b.shape for b in lay.blocks} == {(4, 2)}
    device = lay.grid[1][2]  # dp 1, tp 2: the lower half of rows, the third pair of columns
    assert lay.blocks[lay.block_of(device)].bounds == ((4, 8), (4, 6))
    assert lay.replicated_over == () and lay.spec == "P('dp', 'tp')"


def test_an_unnamed_axis_puts_the_same_block_on_several_devices(mesh):
    lay = mesh_diagram.layout(mesh, NamedSharding(mesh, P(None, "tp")), (8, 8))
    assert lay.replicated_over == ("dp",)
    assert [b.devices for b in lay.blocks] == [(lay.grid[0][c], lay.grid[1][c]) for c in range(4)]
    assert lay.block_of(lay.grid[0][1]) == lay.block_of(lay.grid[1][1])
    assert {b.shape for b in lay.blocks} == {(8, 2)}


def test_another_spec_moves_the_blocks(mesh):
    split = mesh_diagram.layout(mesh, NamedSharding(mesh, P("dp", "tp")), (8, 8))
    swapped = mesh_diagram.layout(mesh, NamedSharding(mesh, P("tp", "dp")), (8, 8))
    device = split.grid[0][1]
    assert split.blocks[split.block_of(device)].bounds == ((0, 4), (2, 4))
    assert swapped.blocks[swapped.block_of(device)].bounds == ((2, 4), (0, 4))


def test_another_mesh_changes_the_grid():
    tall = devices.make_mesh((4, 2), ("dp", "tp"))
    lay = mesh_diagram.layout(tall, NamedSharding(tall, P("dp", "tp")), (8, 8))
    assert len(lay.grid) == 4 and len(lay.grid[0]) == 2 and {b.shape for b in lay.blocks} == {(2, 4)}


def test_a_sharding_on_another_mesh_is_refused(mesh):
    other = devices.make_mesh((8,), ("fsdp",))
    with pytest.raises(ValueError, match="not the mesh drawn"):
        mesh_diagram.layout(mesh, NamedSharding(other, P("fsdp")), (8, 8))


def test_the_drawing_labels_what_layout_says(mesh):
    import matplotlib.pyplot as plt

    arrays = {name: jax.ShapeDtypeStruct((8, 8), "float32", sharding=NamedSharding(mesh, spec))
              for name, spec in {"split": P("dp", "tp"), "cols": P(None, "tp")}.items()}
    fig = mesh_diagram.draw(mesh, arrays, title="a title")
    try:
        found = texts(fig)
        g = mesh_diagram.layout(mesh, arrays["cols"].sharding, (8, 8)).grid
        assert "a title" in found
        assert f"dev {g[0][0]}\ndev {g[1][0]}" in found  # the replicated block names both its devices
        assert sum(t == f"dev {g[1][3]}" for t in found) == 1  # in the split array, a block of its own
        assert any(t.startswith("split: shape (8, 8), P('dp', 'tp'), (4, 2)") for t in found)
        assert any("names no 'dp'" in t for t in found)
        assert sum(f"device {d}" == t for t in found for row in g for d in row) == 16  # the grid, once per array
    finally:
        plt.close(fig)


def test_devices_holding_the_same_block_share_a_colour(mesh):
    import matplotlib.pyplot as plt

    for spec, colours in ((P("dp", "tp"), 8), (P(None, "tp"), 4), (P(), 1)):
        fig = mesh_diagram.draw(mesh, jax.ShapeDtypeStruct((8, 8), "float32", sharding=NamedSharding(mesh, spec)))
        try:
            fills = {p.get_facecolor() for ax in fig.axes for p in ax.patches}
            assert len(fills) == colours, spec
        finally:
            plt.close(fig)
