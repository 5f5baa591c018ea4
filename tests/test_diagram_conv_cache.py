"""The conv-cache diagram is drawn from the VAE's own frame batches and the conv's own kernel."""

from __future__ import annotations

import jax.numpy as jnp
import matplotlib
import pytest
from flax import nnx

from tpupedia.diagrams import conv_cache
from tpupedia.models.cogvideox_vae import CausalConv3d, frame_batches

matplotlib.use("Agg")  # no window: the tests read the figure's artists


def _conv(k: int) -> CausalConv3d:
    return CausalConv3d(2, 2, k, dtype=jnp.float32, param_dtype=jnp.float32, precision=None, rngs=nnx.Rngs(0))


def test_the_notebooks_case_two_batches_of_two_with_a_kernel_of_three():
    lay = conv_cache.layout(frame_batches(4, 2), 3)
    first, second = lay.rows
    assert (first.start, first.end, first.slots, first.pad, first.cached) == (0, 2, (0, 0, 0, 1), (0, 0), False)
    assert first.cache == (0, 1)  # the last two slots of its padded input
    assert (second.slots, second.pad, second.cached) == ((0, 1, 2, 3), (0, 1), True)
    assert lay.window(2) == (1, (0, 1, 2), (0, 1, 2))  # the first output of batch 1 reaches into the cache
    assert lay.window(0) == (0, (-2, -1, 0), (0, 0, 0))  # frame 0 sees only copies of itself


def test_the_batches_are_the_decoders_own():
    for n, b in [(13, 2), (4, 3), (7, 2), (5, 1)]:
        assert [(r.start, r.end) for r in conv_cache.layout(frame_batches(n, b), 3).rows] == frame_batches(n, b)
    assert conv_cache.layout(frame_batches(13, 2), 3).rows[0].slots == (0, 0, 0, 1, 2)  # the odd frame rides with batch 0


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("n,b", [(4, 1), (4, 2), (13, 2), (9, 3), (3, 4)])
def test_with_the_cache_every_batch_sees_what_one_unbatched_causal_conv_sees(n, b, k):
    """Slot at column c holds frame max(c, 0): the cache makes batching exact, even for a batch
    shorter than the kernel (its cache then still holds padding)."""
    lay = conv_cache.layout(frame_batches(n, b), k)
    for r in lay.rows:
        assert len(r.pad) == k - 1 and len(r.cache) == k - 1
        assert r.slots == tuple(max(c, 0) for c in range(r.first, r.end))
    for t in range(n):
        assert lay.window(t)[2] == tuple(max(c, 0) for c in range(t - k + 1, t + 1))


def test_a_batch_of_one_hands_on_padding_in_its_cache():
    rows = conv_cache.layout(frame_batches(4, 1), 3).rows
    assert [r.cache for r in rows] == [(0, 0), (0, 1), (1, 2), (2, 3)]


def test_kernel_t_is_read_from_the_conv():
    assert conv_cache.kernel_t(_conv(3)) == 3 and conv_cache.kernel_t(_conv(1)) == 1
    assert conv_cache.kernel_t(_conv(3).conv) == 3  # a conv holding its kernel directly


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_the_drawing_follows_the_conv_and_the_batches():
    import matplotlib.pyplot as plt

    k3, k1, b1 = conv_cache.draw(frame_batches(4, 2), _conv(3)), conv_cache.draw(frame_batches(4, 2), _conv(1)), conv_cache.draw(frame_batches(4, 1), _conv(3))
    try:
        assert "batch 0 input (frames 0–1),\npadded with 2 copies of frame 0" in _texts(k3)
        assert "conv output\n(output 2 sees frames 0, 1, 2)" in _texts(k3)
        assert "cache: the last 2 of batch 0's padded input" in _texts(k3)
        assert not any("cache:" in t for t in _texts(k1))  # a time kernel of 1 needs no padding, no cache
        assert "conv output\n(output 2 sees frames 2)" in _texts(k1)
        assert sum(t.startswith("batch ") and "input" in t for t in _texts(b1)) == 4  # four batches of one
        assert "conv output\n(output 1 sees frames 0, 0, 1)" in _texts(b1)
        # one box per latent frame, per padded slot and per output frame
        patches = lambda fig: len(fig.axes[0].patches)  # noqa: E731
        assert patches(k3) == 4 + (4 + 4) + 4 + 1  # + the focus window
        assert patches(k1) == 4 + (2 + 2) + 4 + 1
    finally:
        for fig in (k3, k1, b1):
            plt.close(fig)


def test_batches_that_skip_or_reorder_frames_are_refused():
    for bad in ([], [(1, 3)], [(0, 2), (3, 4)], [(0, 2), (2, 2)]):
        with pytest.raises(ValueError, match="batches that cover frames 0.. in order"):
            conv_cache.layout(bad, 3)
