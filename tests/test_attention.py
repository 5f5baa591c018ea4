"""tpupedia.attention: splash (interpret mode on CPU) and the reference against jax.nn attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpupedia import attention as A
from tpupedia import devices

TOL = 1e-5


def _rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(b, h, hkv, sq, skv, d, seed=0):
    return _rand(seed, b, h, sq, d), _rand(seed + 1, b, hkv, skv, d), _rand(seed + 2, b, hkv, skv, d)


def _jax_nn(q, k, v, mask=None, is_causal=False):
    """The oracle: jax.nn.dot_product_attention, with fully masked rows set to 0 (PyTorch CPU)."""
    def t(x):
        return x.transpose(0, 2, 1, 3)

    out = t(jax.nn.dot_product_attention(t(q), t(k), t(v), mask=mask, is_causal=is_causal))
    if mask is not None:
        out = jnp.where(jnp.broadcast_to(mask, out.shape[:3] + (k.shape[2],)).any(-1)[..., None], out, 0)
    return np.asarray(out)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), b, atol=TOL, rtol=0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "blocks, match",
    [((100, 128), "block_q=100 is not a positive multiple of 128"),
     ((128, 384), "block_kv=384 exceeds the padded sequence length 256"),
     ((128, 256, 96), "block_kv_compute=96 is not a positive multiple of 128"),
     ((128, 256, 256 + 128), "block_kv_compute=384 exceeds")],
)
def test_bad_block_sizes_name_value_and_rule(blocks, match):
    with pytest.raises(A.AttentionError, match=match):
        A.check_block_sizes(blocks, 200, 200)


def test_block_kv_compute_must_divide_block_kv():
    with pytest.raises(A.AttentionError, match="block_kv_compute=256 must divide block_kv=384"):
        A.check_block_sizes((128, 384, 256), 400, 400)


def test_mismatched_head_dims_and_heads():
    q, k, v = _qkv(1, 4, 2, 8, 8, 16)
    with pytest.raises(A.AttentionError, match="head dims differ: q 16, k 8"):
        A.attention(q, k[..., :8], v)
    with pytest.raises(A.AttentionError, match="not a multiple of 3"):
        A.attention(q, _rand(0, 1, 3, 8, 16), _rand(1, 1, 3, 8, 16))
    with pytest.raises(A.AttentionError, match="backend='cuda'"):
        A.attention(q, k, v, backend="cuda")


# --------------------------------------------------------------------------- numerics


def test_splash_odd_lengths_gqa_cross_attention():
    q, k, v = _qkv(2, 4, 2, 77, 131, 16)
    out = jax.jit(A.attention)(q, k, v)
    _close(out, _jax_nn(q, k, v))


def test_splash_causal_odd_length_matches_and_kernel_is_reused():
    q, k, v = _qkv(1, 2, 2, 130, 130, 8, seed=3)
    before = A.cache_info()
    f = jax.jit(lambda q, k, v: A.attention(q, k, v, is_causal=True))
    _close(f(q, k, v), _jax_nn(q, k, v, is_causal=True))
    _close(f(q * 2, k, v), _jax_nn(q * 2, k, v, is_causal=True))
    jax.jit(lambda q, k, v: A.attention(q, k, v, is_causal=True))(q, k, v)  # new jit, same kernel
    after = A.cache_info()
    assert after.misses - before.misses == 1 and after.hits > before.hits


def test_padded_text_and_fully_masked_rows_take_exact_splash_branch():
    b, s = 2, 150
    q, k, v = _qkv(b, 2, 1, s, s, 8, seed=5)
    valid = jnp.arange(s)[None, :] < jnp.array([[97], [150]])
    mask = (valid[:, None, :, None] & valid[:, None, None, :])  # padded queries see nothing
    _, _, exact = A.split_mask(mask, causal=False)
    assert bool(exact)
    out = jax.jit(A.attention)(q, k, v, mask)
    _close(out, _jax_nn(q, k, v, mask))
    assert not np.isnan(np.asarray(out)).any()
    assert np.all(np.asarray(out)[0, :, 97:] == 0)


def test_hf_style_causal_padding_mask_and_unrepresentable_mask():
    b, s = 2, 64
    q, k, v = _qkv(b, 2, 2, s, s, 8, seed=7)
    valid = jnp.arange(s)[None, :] >= jnp.array([[5], [0]])  # left padding
    causal = jnp.tril(jnp.ones((s, s), bool))
    mask = causal[None, None] & valid[:, None, None, :]
    _, _, exact_causal = A.split_mask(mask, causal=True)
    assert bool(exact_causal)
    f = jax.jit(A.attention)
    _close(f(q, k, v, mask), _jax_nn(q, k, v, mask))
    random_mask = jnp.asarray(np.random.default_rng(0).random((b, 1, s, s)) > 0.3)
    _close(f(q, k, v, random_mask), _jax_nn(q, k, v, random_mask))  # reference branch


def test_trusted_mask_structure_and_reference_backend():
    q, k, v = _qkv(1, 2, 2, 40, 40, 8, seed=9)
    valid = jnp.arange(40)[None, :] < 33
    mask = valid[:, None, None, :]
    expect = _jax_nn(q, k, v, mask)
    f = jax.jit(A.attention, static_argnames=("mask_structure", "backend"))
    _close(f(q, k, v, mask, mask_structure="padding"), expect)
    _close(f(q, k, v, mask, backend="reference"), expect)


def test_head_parallel_and_sequence_fallback_on_mesh():
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    q, k, v = _qkv(2, 4, 2, 100, 100, 8, seed=11)
    _close(jax.jit(lambda q, k, v: A.attention(q, k, v, is_causal=True, mesh=mesh))(q, k, v),
           _jax_nn(q, k, v, is_causal=True))
    q3, k3, v3 = _qkv(2, 3, 3, 60, 20, 8, seed=13)
    with pytest.warns(A.AttentionLayoutWarning, match="3 heads do not divide"):
        out = jax.jit(lambda q, k, v: A.attention(q, k, v, mesh=mesh))(q3, k3, v3)
    _close(out, _jax_nn(q3, k3, v3))


# --------------------------------------------------------------------------- torchax


def test_install_attention_matches_torch_sdpa():
    import torch
    import torch.nn.functional as F

    from tpupedia.compat import import_torchax

    torchax = import_torchax()
    env = torchax.default_env()
    from tpupedia.torchax_utils import restoring_ops

    with restoring_ops(env):  # the default env is shared by every later test
        info = A.install_attention(env, block_sizes=(256, 256))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 37, 8, generator=g)
        k = torch.randn(2, 2, 37, 8, generator=g)
        v = torch.randn(2, 2, 37, 8, generator=g)
        mask = torch.ones(2, 1, 37, 37, dtype=torch.bool).tril()
        mask[1, ..., :4] = False  # keys 0-3 of batch 1 are padding; its queries 0-3 see nothing
        expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        expect = torch.where(mask.any(-1, keepdim=True), expect, 0)
        with env:
            got = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"),
                                                 attn_mask=mask.to("jax"), enable_gqa=True)
            got_causal = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"),
                                                        is_causal=True, scale=0.3, enable_gqa=True)
            got, got_causal = got.to("cpu"), got_causal.to("cpu")
    np.testing.assert_allclose(got.numpy(), expect.numpy(), atol=TOL, rtol=0)
    expect_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    np.testing.assert_allclose(got_causal.numpy(), expect_causal.numpy(), atol=TOL, rtol=0)
    assert info.calls == 2 and info.backend == "splash"
