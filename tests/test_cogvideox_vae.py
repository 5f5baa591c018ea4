"""Parity of the Flax NNX CogVideoX VAE with diffusers (float32, random weights), tiling,
bf16, weight loading from safetensors and input validation. Notebook `cogvideox_vae_flax`'s asserts prove the tiny
config's encode/decode, its tiled decode and the layer-diff tool (`compare_layers`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX as TorchVAE

from tpupedia.models import cogvideox_vae_convert as convert
from tpupedia.models.cogvideox_vae import (
    CogVideoXVAEConfig,
    VAEConfigError,
    VAEInputError,
    frame_batches,
    tiny_config,
)

TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: dict
    video: tuple[int, ...]  # (B, C, T, H, W)
    latents: tuple[int, ...]
    tiles: tuple[int, int] | None = None  # tile_sample_min (height, width): forces tiling


CASES = [
    # the course's tiny config: 9 frames, non-square, 4 latent frames (two decode batches)
    Case("tiny-9f", dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=2),
         (1, 3, 9, 32, 40), (1, 4, 4, 4, 5)),
    # 3 levels, wider channels, 8 groups, 13 frames, 2 resnets per block
    Case("wide-13f", dict(block_out_channels=(8, 16, 16), latent_channels=6, norm_num_groups=8, layers_per_block=2),
         (1, 3, 13, 12, 20), (1, 6, 3, 3, 5)),
    # 2 levels, temporal x2, 3 latent channels, batch of 2
    Case("t2-b2", dict(block_out_channels=(4, 8), latent_channels=3, norm_num_groups=4, temporal_compression_ratio=2),
         (2, 3, 13, 10, 6), (2, 3, 3, 5, 3)),
    # 17 frames: two encoder frame batches, so the encoder's conv cache is exercised too
    Case("17f-cache", dict(block_out_channels=(4, 8, 8), latent_channels=2, norm_num_groups=4),
         (1, 3, 17, 8, 12), (1, 2, 3, 2, 3)),
    # tiling with tiny tiles (32x32 pixels, 4x4 latents) along the width, on the tiny config;
    # diffusers itself cannot encode edge tiles narrower than ~9 pixels, hence these sizes
    Case("tiny-tiled", dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=2),
         (1, 3, 9, 24, 64), (1, 4, 3, 3, 7), tiles=(32, 32)),
]


def _torch_vae(case: Case) -> TorchVAE:
    cfg = tiny_config(**case.config)
    torch.manual_seed(0)
    vae = TorchVAE(
        block_out_channels=cfg.block_out_channels,
        latent_channels=cfg.latent_channels,
        layers_per_block=cfg.layers_per_block,
        norm_num_groups=cfg.norm_num_groups,
        temporal_compression_ratio=cfg.temporal_compression_ratio,
        down_block_types=("CogVideoXDownBlock3D",) * len(cfg.block_out_channels),
        up_block_types=("CogVideoXUpBlock3D",) * len(cfg.block_out_channels),
    ).eval()
    # GroupNorm affine parameters start at 1/0 in torch; randomise them so a swapped scale/bias
    # or a wrong grouping cannot hide.
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    if case.tiles:
        vae.enable_tiling(tile_sample_min_height=case.tiles[0], tile_sample_min_width=case.tiles[1])
    return vae


# Notebook `cogvideox_vae_flax` proves the tiny config's encode and decode and its tiled decode, with
# the same seeds and TOL: the tests below cover the other configs, and the tiled encode.
ENCODE_CASES = [c for c in CASES if c.name != "tiny-9f"]
DECODE_CASES = [c for c in CASES if c.name not in ("tiny-9f", "tiny-tiled")]


@pytest.fixture(scope="module")
def pair(request):
    """(case, torch VAE, Flax VAE) for the case a test is parametrised with (`indirect`)."""
    case = request.param
    tv = _torch_vae(case)
    return case, tv, convert.from_diffusers(tv)


def _inputs(case: Case):
    g = torch.Generator().manual_seed(1)
    return torch.randn(case.video, generator=g), torch.randn(case.latents, generator=g)


@pytest.mark.parametrize("pair", ENCODE_CASES, ids=lambda c: c.name, indirect=True)
def test_encode_parity(pair):
    case, tv, fv = pair
    x, _ = _inputs(case)
    with torch.no_grad():
        ref = tv.encode(x).latent_dist
    got = fv.encode(jnp.asarray(x.numpy()))
    assert got.parameters.shape == tuple(ref.parameters.shape)
    assert float(np.max(np.abs(np.asarray(got.parameters) - ref.parameters.numpy()))) <= TOL
    assert float(np.max(np.abs(np.asarray(got.logvar) - ref.logvar.numpy()))) <= TOL


@pytest.mark.parametrize("pair", DECODE_CASES, ids=lambda c: c.name, indirect=True)
def test_decode_parity(pair):
    case, tv, fv = pair
    _, z = _inputs(case)
    with torch.no_grad():
        ref = tv.decode(z).sample.numpy()
    got = np.asarray(fv.decode(jnp.asarray(z.numpy())))
    assert got.shape == ref.shape
    assert float(np.max(np.abs(got - ref))) <= TOL


@pytest.mark.parametrize("chips, axis", [(4, 2), (5, 3)], ids=["height", "width"])
def test_a_decode_split_over_chips_is_the_same_decode(chips, axis):
    """`decode(spatial=...)` splits every activation by height (4 latent rows over 4 chips) or
    width (5 columns over 5) over simulated chips and gives the same video as the decode on one
    device, float32. The decode runs two frame batches, so the causal cache crosses calls split too."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpupedia import devices

    case = CASES[0]
    tv = _torch_vae(case)
    fv = convert.from_diffusers(tv)
    _, z = _inputs(case)
    with torch.no_grad():
        ref = tv.decode(z).sample.numpy()
    mesh = devices.make_mesh((chips,), ("tiles",), devices=jax.devices()[:chips])
    split = NamedSharding(mesh, P(*("tiles" if i == axis else None for i in range(5))))
    nnx.update(fv, jax.device_put(nnx.state(fv), NamedSharding(mesh, P())))  # a copy of the weights per chip
    got = fv.decode(jnp.asarray(z.numpy()), spatial=split)
    assert got.sharding.device_set == set(mesh.devices.flat)  # computed on the chips, not gathered to one
    assert float(np.max(np.abs(np.asarray(got) - ref))) <= TOL


def test_tiling_really_tiles():
    # the tiled case's inputs are larger than one tile, in both directions
    case = CASES[-1]
    th, tw = case.tiles
    assert case.video[4] > tw and case.latents[4] > tw // 8


def test_bf16_decode_close():
    case = CASES[0]
    tv = _torch_vae(case)
    fv = convert.from_diffusers(tv, dtype=jnp.bfloat16)
    z = torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = tv.decode(z).sample.numpy()
    got = fv.decode(jnp.asarray(z.numpy()))
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    # bf16 keeps 8 mantissa bits: expect ~1e-2 relative drift through ~20 layers, not 1e-5
    assert float(np.max(np.abs(got - ref))) <= 0.05 * float(np.max(np.abs(ref)))


def test_from_pretrained_roundtrip(tmp_path):
    tv = _torch_vae(CASES[2])
    tv.save_pretrained(tmp_path, safe_serialization=True)
    assert not list(tmp_path.glob("*.bin"))
    loaded = convert.from_pretrained(tmp_path)
    direct = convert.from_diffusers(tv)
    assert loaded.config == direct.config
    from flax import nnx

    a = nnx.to_flat_state(nnx.state(loaded, nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(direct, nnx.Param)))
    assert len(a) == len(b) == len(tv.state_dict())
    for path, var in a:
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(b[path].get_value()))


def test_weight_mapping_table():
    path, rule = convert.nnx_path("decoder.up_blocks.0.resnets.1.conv1.conv.weight", 5)
    assert path == ("decoder", "up_blocks", 0, "resnets", 1, "conv1", "conv", "kernel")
    assert rule.transpose == (2, 3, 4, 1, 0)
    assert convert.nnx_path("_orig_mod.encoder.norm_out.weight", 1)[0] == ("encoder", "norm_out", "scale")
    with pytest.raises(convert.WeightConversionError, match="no conversion rule"):
        convert.nnx_path("encoder.conv_in.conv.weight", 3)


def test_state_dict_mismatch_is_reported():
    tv = _torch_vae(CASES[2])
    sd = dict(tv.state_dict())
    sd.pop("decoder.conv_out.conv.bias")
    with pytest.raises(convert.WeightConversionError, match="missing.*decoder.conv_out.conv.bias"):
        convert.from_state_dict(dict(tv.config), sd)


def test_frame_batches_match_diffusers_loop():
    assert frame_batches(13, 2) == [(0, 3), (3, 5), (5, 7), (7, 9), (9, 11), (11, 13)]
    assert frame_batches(4, 2) == [(0, 2), (2, 4)]
    assert frame_batches(17, 8) == [(0, 9), (9, 17)]
    assert frame_batches(1, 2) == [(0, 1)]


def test_abstract_vae_is_the_tree_a_real_rngs_builds():
    """`abstract_vae` hands the layers one fixed key instead of an `nnx.Rngs` (whose traced draw
    counts make `eval_shape` quadratic in the layers): the same module tree, shapes and dtypes."""
    from flax import nnx

    from tpupedia.models.cogvideox_vae import AutoencoderKLCogVideoX

    kwargs = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    ours = nnx.split(convert.abstract_vae(tiny_config(), **kwargs))
    real = nnx.split(nnx.eval_shape(lambda: AutoencoderKLCogVideoX(tiny_config(), rngs=nnx.Rngs(0), **kwargs)))
    assert ours[0] == real[0]
    a, b = dict(nnx.to_flat_state(ours[1])), dict(nnx.to_flat_state(real[1]))
    assert a.keys() == b.keys()
    for path, var in a.items():
        got, want = var.get_value(), b[path].get_value()
        assert (type(var), got.shape, got.dtype) == (type(b[path]), want.shape, want.dtype), path


@pytest.fixture(scope="module")
def tiny_flax():
    # shapes only: validation happens before any weight is touched
    return convert.abstract_vae(tiny_config())


@pytest.mark.parametrize(
    "shape, match",
    [
        ((1, 3, 2, 4, 5), "latent_channels=4"),
        ((1, 2, 4, 5, 4), "channels-last"),
        ((1, 4, 0, 4, 4), "empty"),
        ((4, 3, 4, 4), "must be \\(B, C, t, h, w\\)"),
    ],
)
def test_bad_latents(tiny_flax, shape, match):
    with pytest.raises(VAEInputError, match=match):
        tiny_flax.decode(np.zeros(shape, np.float32))


@pytest.mark.parametrize(
    "shape, match",
    [
        ((1, 3, 10, 16, 16), "10 frames.*1 \\+ 4\\*k frames \\(1, 5, 9, 13, 17"),
        ((1, 3, 0, 16, 16), "0 frames"),
        ((1, 16, 16, 9, 3), "16 channels"),
        ((3, 9, 16, 16), "must be \\(B, C, T, H, W\\)"),
    ],
)
def test_bad_video(tiny_flax, shape, match):
    with pytest.raises(VAEInputError, match=match):
        tiny_flax.encode(np.zeros(shape, np.float32))


def test_bad_config():
    with pytest.raises(VAEConfigError, match="does not divide"):
        tiny_config(norm_num_groups=3)
    with pytest.raises(VAEConfigError, match="power of 2"):
        tiny_config(temporal_compression_ratio=3)
    assert CogVideoXVAEConfig.from_dict({"_class_name": "x", "latent_channels": 16}).latent_channels == 16
