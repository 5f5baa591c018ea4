"""The MLP-split diagram is driven by the real shardings of the two weights and the collectives
of the compiled program: change either and the lanes or the counted collectives change."""

import jax
import jax.numpy as jnp
import matplotlib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot, devices
from tpupedia.diagrams import mlp_split

matplotlib.use("Agg")

B, S, D, F = 8, 4, 16, 32


def abstract(mesh, shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def megatron(mesh, fc2_spec=P(None, "tp")):
    return abstract(mesh, (B, S, D), P("dp")), abstract(mesh, (F, D), P("tp", None)), abstract(mesh, (D, F), fc2_spec)


def lay(x, fc1, fc2, ops=()):
    return mlp_split.layout(x.sharding, x.shape, fc1.sharding, fc1.shape, fc2.sharding, fc2.shape, ops)


def test_lanes_follow_the_tp_axis():
    for shape, lanes in (((2, 4), 4), ((4, 2), 2)):
        mesh = devices.make_mesh(shape, ("dp", "tp"))
        out = lay(*megatron(mesh))
        width = F // lanes
        assert out.axis == "tp" and len(out.lanes) == lanes
        assert [lane.fc1_rows for lane in out.lanes] == [(i * width, (i + 1) * width) for i in range(lanes)]
        assert all(lane.fc1_rows == lane.fc2_cols for lane in out.lanes)  # the row split matches the column split
        assert [lane.devices for lane in out.lanes] == [tuple(int(d.id) for d in mesh.devices[:, i]) for i in range(lanes)]
        assert out.x_whole_on_axis and out.x_block == (B // shape[0], S, D) and out.out_block == (B // shape[0], S, D)


def test_a_replicated_fc2_shows_whole_columns_and_a_split_x_does_not_claim_replication():
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    x, fc1, fc2 = megatron(mesh, P())
    out = lay(abstract(mesh, (B, S, D), P("dp", None, "tp")), fc1, fc2)
    assert {lane.fc2_cols for lane in out.lanes} == {(0, F)}
    assert not out.x_whole_on_axis and out.fc2_spec == "P()" and out.fc2_split is None
    assert lay(x, fc1, abstract(mesh, (D, F), P(None, "tp"))).fc2_split == 1


def test_fc1_must_be_column_parallel():
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    x, _, fc2 = megatron(mesh)
    with pytest.raises(ValueError, match="not column-parallel"):
        lay(x, abstract(mesh, (F, D), P(None, "tp")), fc2)


def test_the_collectives_drawn_are_those_of_the_compiled_program():
    import matplotlib.pyplot as plt

    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    x, fc1, fc2 = megatron(mesh)
    mlp = jax.jit(lambda x, w1, w2: jax.nn.gelu(x @ w1.T) @ w2.T, out_shardings=NamedSharding(mesh, P("dp")))
    ops = aot.collective_ops(mlp.lower(x, fc1, fc2).compile().as_text(), 8)
    assert lay(x, fc1, fc2, ops).collectives == (("all-reduce", 1, 4),)
    twice = [ops[0], ops[0]]
    assert lay(x, fc1, fc2, twice).collectives == (("all-reduce", 2, 4),)
    fig = mlp_split.draw(x, fc1, fc2, ops, title="t")
    try:
        found = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert "all-reduce\n× 1\nover 4\ndevices" in found
        assert "h = gelu(x @ fc1[8:16].T)\n(4, 4, 8): features 8:16" in found
        assert any(t.startswith("fc2 (16, 32), P(None, 'tp')\nrow-parallel") for t in found)
    finally:
        plt.close(fig)
    fig = mlp_split.draw(x, fc1, fc2, [])
    try:
        assert "no\ncollective" in [t.get_text() for ax in fig.axes for t in ax.texts]
    finally:
        plt.close(fig)
