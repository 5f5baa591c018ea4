"""The jit-friendly HunyuanVideo-1.5 forward is the stock forward, op for op, on torch CPU."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from tpupedia.models.hunyuan import make_static, static_forward, tiny_transformer_config


def _tiny():
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config()).eval()


@pytest.mark.parametrize("padded", [False, True])
def test_static_forward_equals_stock_forward(padded):
    model = _tiny()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 9, 3, 4, 4, generator=g)
    t = torch.tensor([500.0])
    text, text_2 = torch.randn(1, 6, 16, generator=g), torch.randn(1, 5, 32, generator=g)
    mask, mask_2 = torch.ones(1, 6, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)
    if padded:
        mask[:, 4:] = 0
        mask_2[:, 3:] = 0
    image = torch.zeros(1, 4, 12)  # text-to-video: no image conditioning
    kwargs = dict(encoder_hidden_states_2=text_2, encoder_attention_mask_2=mask_2, image_embeds=image, return_dict=False)
    with torch.no_grad():
        stock = model(x, t, text, mask, **kwargs)[0]
        static = static_forward(model, x, t, text, mask, **kwargs)[0]
        via_method = make_static(model)(x, t, text, mask, **kwargs)[0]
    assert torch.equal(static, stock)
    assert torch.equal(via_method, stock)


def _inputs(padded: bool = True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 3, 4, 4, generator=g)
    t = torch.tensor([500.0, 500.0])
    text, text_2 = torch.randn(2, 6, 16, generator=g), torch.randn(2, 5, 32, generator=g)
    mask, mask_2 = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    if padded:
        mask[0, 4:] = 0
        mask[1, 2:] = 0
        mask_2[:, 3:] = 0
    return x, t, text, mask, text_2, mask_2, torch.zeros(2, 4, 12)


def test_padding_processor_keeps_the_mask_a_vector_and_equals_stock():
    """`PaddingAttnProcessor` never builds (B, 1, S, S) in the blocks, and gives the stock output."""
    from tpupedia.models import hunyuan

    model = _tiny()
    x, t, text, mask, text_2, mask_2, image = _inputs()
    kwargs = dict(encoder_hidden_states_2=text_2, encoder_attention_mask_2=mask_2, image_embeds=image, return_dict=False)
    with torch.no_grad():
        stock = model(x, t, text, mask, **kwargs)[0]
        shapes = []

        def attend(q, k, v, valid):
            shapes.append(tuple(valid.shape))
            return hunyuan.torch_padded_attention(q, k, v, valid)

        hunyuan.make_jit_friendly(model, attend)
        ours = model(x, t, text, mask, **kwargs)[0]
    assert torch.equal(ours, stock)
    s = 3 * 4 * 4 + 4 + 5 + 6  # video tokens + image + ByT5 + Qwen slots
    assert shapes == [(2, s)] * len(model.transformer_blocks)  # a (B, S) vector reached every block


def test_deepcache_pieces_recompose_the_forward():
    """The full DeepCache forward returns the plain output; a cached step from its own cache at
    the same timestep gives that output again (the tail recomputed from the cut)."""
    from tpupedia.models import hunyuan

    model = _tiny()
    x, t, text, mask, text_2, mask_2, image = _inputs()
    with torch.no_grad():
        plain = static_forward(model, x, t, text, mask, None, text_2, mask_2, image, return_dict=False)[0]
        full, cache = hunyuan.deepcache_full(model, 1, x, t, text, mask, text_2, mask_2, image)
        again = hunyuan.deepcache_cached(model, 1, cache, x, t, mask, mask_2, image)
        later = hunyuan.deepcache_cached(model, 1, cache, x, t * 0.5, mask, mask_2, image)
    assert torch.equal(full, plain) and torch.equal(again, plain)
    assert not torch.equal(later, plain)  # the timestep embedding of the cached step is its own


def test_padded_attention_matches_torch_and_zeroes_padded_rows():
    """`tpupedia.attention.padded_attention` (reference and splash in interpret mode) against
    torch SDPA with diffusers' pairwise mask; rows of padded tokens are 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpupedia import attention
    from tpupedia.models import hunyuan

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 200, 8, generator=g) for _ in range(3))
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[0, 150:] = False
    valid[1, 60:] = False
    expected = hunyuan.torch_padded_attention(q, k, v, valid).numpy()
    for backend in ("reference", "splash"):
        out = jax.jit(lambda *a: attention.padded_attention(*a, backend=backend, interpret=True))(
            *(jnp.asarray(t.numpy()) for t in (q, k, v, valid)))
        out = np.asarray(out)
        rows = valid.numpy()
        assert np.abs(out - expected)[np.broadcast_to(rows[:, None, :, None], out.shape)].max() <= 1e-5
        assert (out[np.broadcast_to(~rows[:, None, :, None], out.shape)] == 0).all(), backend


@pytest.mark.parametrize("n_frame, n_hw, batch", [(1, 4, None), (3, 5, 2), (4, 1, 1)])
def test_vae_attention_mask_is_diffusers_mask(n_frame, n_hw, batch):
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    from tpupedia.models.hunyuan import vae_attention_mask

    for dtype in (torch.float32, torch.bfloat16):
        want = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n_frame, n_hw, dtype, "cpu", batch_size=batch)
        got = vae_attention_mask(n_frame, n_hw, dtype, "cpu", batch_size=batch)
        if batch is not None:  # ours has the head axis the attention's scores have (see the next test)
            assert got.shape == (batch, 1, n_frame * n_hw, n_frame * n_hw)
            got = got[:, 0]
        assert got.dtype == dtype and torch.equal(got, want)
    assert got[..., 0, n_hw:].eq(float("-inf")).all() and got[..., -1, :].eq(0).all()  # causal over frames


def test_jit_friendly_vae_decodes_as_stock():
    """Every mid-block attention gets the loop-free mask; the decode is unchanged up to rounding
    (PyTorch's CPU attention rounds a `(1, 1, S, S)` mask's sum differently from a `(1, S, S)` one:
    about 1e-6 on outputs of magnitude 1.5; the bound is 1e-5)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from tpupedia.models.hunyuan import make_vae_jit_friendly, tiny_vae_config, vae_attention_mask

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(**tiny_vae_config()).eval()
    z = torch.randn(1, tiny_vae_config()["latent_channels"], 2, 3, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = vae.decode(z).sample
        patched = make_vae_jit_friendly(vae).decode(z).sample
    blocks = [m for m in vae.modules() if type(m).__name__ == "HunyuanVideo15AttnBlock"]
    assert blocks and all(b.prepare_causal_attention_mask is vae_attention_mask for b in blocks)
    assert torch.allclose(patched, stock, rtol=0, atol=1e-5), float((patched - stock).abs().max())


def test_jit_friendly_vae_decodes_a_batch_as_its_samples_alone():
    """Stock diffusers 0.42.1 cannot decode a batch of two latents in one decoder call (its mask
    broadcasts the batch against itself); the loop-free mask keeps a head axis, so a batch decodes
    each sample as alone, which decoding tiles side by side relies on."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from tpupedia.models.hunyuan import make_vae_jit_friendly, tiny_vae_config

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(**tiny_vae_config()).eval()
    z = torch.randn(2, tiny_vae_config()["latent_channels"], 2, 3, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="shape"):
            vae.decoder(z)  # stock: (2, 2, S, S) scores cannot be reshaped to one video per sample
        alone = torch.cat([vae.decoder(z[:1]), vae.decoder(z[1:])])
        together = make_vae_jit_friendly(vae).decoder(z)
    assert torch.allclose(together, alone, atol=1e-5), float((together - alone).abs().max())


def test_keeping_only_the_valid_text_tokens_leaves_the_output_unchanged():
    """The blocks see the valid text tokens (most of any sample in the batch, here 3 + 3) and
    nothing after them: the same video output as all 15 slots, and one token fewer changes it."""
    from tpupedia.models import hunyuan

    model = make_static(_tiny())
    x, t, text, mask, text_2, mask_2, image = _inputs()
    kwargs = dict(encoder_hidden_states_2=text_2, encoder_attention_mask_2=mask_2, image_embeds=image, return_dict=False)
    most = int((mask.sum(1) + mask_2.sum(1)).max())
    assert most == 7 and hunyuan.kept_text_tokens((mask.sum(1) + mask_2.sum(1)).tolist(), 15, multiple=1) == 7
    with torch.no_grad():
        every = model(x, t, text, mask, **kwargs)[0]
        kept = model(x, t, text, mask, **kwargs, text_tokens=most)[0]
        too_few = model(x, t, text, mask, **kwargs, text_tokens=most - 1)[0]
    assert float((kept - every).abs().max()) < 1e-6
    assert float((too_few - every).abs().max()) > 1e-4


@pytest.mark.parametrize("counts, slots, kept", [([5, 7], 1985, 128), ([463, 470], 1985, 512), ([1985], 1985, 1985),
                                                 ([1900, 3], 1985, 1920), ([0, 0], 1985, 128), ([130], 200, 200)])
def test_kept_text_tokens_round_up_to_a_multiple_and_never_past_the_slots(counts, slots, kept):
    from tpupedia.models import hunyuan

    assert hunyuan.kept_text_tokens(counts, slots) == kept


def test_a_full_size_step_keeps_every_text_slot_so_it_compiles_once():
    """At 720p and 121 frames the 1,985 text slots are under 2% of the sequence: every prompt keeps
    all of them (one compiled 54-layer step, the plan's), where the tiny model, text-heavy, cuts."""
    from tpupedia.models import hunyuan

    slots = sum(n for n, _ in hunyuan.TEXT_SLOTS.values())
    video = hunyuan.video_tokens(1280, 720, 121)
    assert slots / (slots + video) < hunyuan.KEEP_ALL_TEXT_BELOW
    assert {hunyuan.kept_text_tokens(counts, slots, video_tokens=video) for counts in ([5, 7], [470], [1985])} == {slots}
    assert hunyuan.kept_text_tokens([5, 7], slots, video_tokens=hunyuan.video_tokens(64, 64, 9)) == 128
