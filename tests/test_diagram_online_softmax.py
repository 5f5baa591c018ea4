"""The online-softmax diagram is driven by the real query row, keys and block size."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from tpupedia.diagrams import online_softmax

S, D = 256, 64


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)  # the arrays of notebook splash_attention, section 1
    return tuple(rng.standard_normal((S, D)).astype(np.float32) for _ in range(3))


def full_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_one_pass_equals_the_full_softmax(qkv):
    q, k, v = qkv
    lay = online_softmax.layout(q[14], k, 64, D**-0.5, v)
    scores = (k @ q[14]) * np.float32(D**-0.5)
    np.testing.assert_allclose(lay.scores, scores, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lay.weights, full_softmax(scores), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lay.weights, lay.softmax, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lay.output, full_softmax(scores) @ v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lay.output, lay.reference, rtol=1e-4, atol=1e-5)


def test_running_values_per_block(qkv):
    q, k, _ = qkv
    lay = online_softmax.layout(q[14], k, 64, D**-0.5)
    assert [(st.start, st.stop) for st in lay.steps] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    block_max = lay.scores.reshape(4, 64).max(-1)
    np.testing.assert_array_equal([st.m_new for st in lay.steps], np.maximum.accumulate(block_max))
    first = lay.steps[0]
    assert first.m_old == -np.inf and first.rescale == 0.0 and first.l_old == 0.0
    for prev, st in zip(lay.steps, lay.steps[1:]):
        assert st.m_old == prev.m_new and st.l_old == prev.l_new
        assert st.rescale == pytest.approx(np.exp(st.m_old - st.m_new))
        assert st.l_new == pytest.approx(st.l_old * st.rescale + st.added, rel=1e-6)
        assert (st.rescale < 1) == st.raised  # a block below the running max leaves l and o as they are
    # query 14 (the notebook's): the max rises at blocks 1 and 3, not at 2
    assert [st.raised for st in lay.steps[1:]] == [True, False, True]
    last = lay.steps[-1]
    assert last.l_new == pytest.approx(float(np.exp(lay.scores - last.m_new).sum()), rel=1e-5)


def test_block_size_sets_the_steps(qkv):
    q, k, _ = qkv
    for block, n in ((32, 8), (64, 4), (128, 2), (100, 3)):
        lay = online_softmax.layout(q[0], k, block)
        assert len(lay.steps) == n and lay.steps[-1].stop == S
        np.testing.assert_allclose(lay.weights, lay.softmax, rtol=1e-5, atol=1e-7)
    assert online_softmax.layout(q[0], k, 100).steps[-1].start == 200  # a shorter last block
    with pytest.raises(ValueError):
        online_softmax.layout(q[0], k, 0)
    with pytest.raises(ValueError):
        online_softmax.layout(q[:2], k, 64)


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_draw_shows_the_layout(qkv):
    q, k, v = qkv
    fig = online_softmax.draw(q[14], k, 64, D**-0.5, v, title="query 14")
    lay = online_softmax.layout(q[14], k, 64, D**-0.5, v)
    texts = _texts(fig)
    assert fig._suptitle.get_text() == "query 14"
    for st in lay.steps:
        assert f"block {st.block}: keys {st.start}–{st.stop - 1}" in texts
        assert any(f"l = {st.l_old:.1f}·c + {st.added:.1f} = {st.l_new:.1f}" in t for t in texts)
    assert any(f"c = {lay.steps[3].rescale:.3f}" in t for t in texts)
    assert any("c = exp(−∞) = 0" in t for t in texts)
    assert sum("(unchanged)" in t for t in texts) == 1  # block 2 leaves m where it was
    width, _ = fig.get_size_inches()
    assert 7 <= width <= 9


def test_draw_follows_the_block_size(qkv):
    q, k, _ = qkv
    fig = online_softmax.draw(q[14], k, 128, D**-0.5)
    texts = _texts(fig)
    assert [t for t in texts if t.startswith("block ")] == ["block 0: keys 0–127", "block 1: keys 128–255"]
    assert "2 key blocks of 128" in fig._suptitle.get_text()
