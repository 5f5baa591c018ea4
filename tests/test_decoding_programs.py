"""The decode stage spread over a host's chips, and its programs (`tpupedia.pipelines.decoding`)
against what the real decode runs.

Tiles of one shape decode side by side, one per chip, and give the frames of decoding them one at
a time. Each family's tiny VAE decodes while its decoder calls are recorded (the NNX port's jitted
`_jit_apply`, traced with `jax.eval_shape`; diffusers' `vae.decoder`, run on PyTorch's `meta`
device); the programs must list exactly those calls, with the same input shapes and dtypes, the
same outputs and the right call counts, tiled and untiled, one piece per chip. A Hunyuan program run with the
real weights must compute the decoder's output.
"""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpupedia import devices
from tpupedia.models import cogvideox, hunyuan
from tpupedia.pipelines import cogvideox as cog_pipeline
from tpupedia.pipelines import decoding
from tpupedia.pipelines import hunyuan as hy_pipeline
from tpupedia.pipelines.common import PipelineError

# CogVideoX tiles of 48x40 pixels (6x5 latents): overlaps of 1/6 and 1/5 are then whole latents.
COG_CONFIG = cogvideox.tiny_vae_config() | {"sample_height": 96, "sample_width": 80}
COG_LATENTS = (7, 64, 88)  # latent frames, video height, width: 8x11 latents, frame batches of 3, 2, 2
HY_LATENTS = (2, 288, 480)  # 18x30 latents: 16x16 tiles every 12 latents, 2 rows x 3 columns
CHIPS = 4  # the decode mesh of these tests: 4 of the 8 simulated devices


def _decode_mesh():
    return devices.make_mesh((CHIPS,), (decoding.AXIS,), devices=jax.devices()[:CHIPS])


def test_waves_group_tiles_by_shape_and_fill_the_last_wave():
    tiles = [np.zeros(s) for s in [(1, 4), (1, 4), (1, 3), (1, 4), (1, 4), (1, 4), (1, 3)]]
    got = [(index, [t.shape for t in wave]) for index, wave in decoding.waves(tiles, 4)]
    assert got == [([0, 1, 3, 4], [(1, 4)] * 4), ([5], [(1, 4)] * 4), ([2, 6], [(1, 3)] * 4)]
    assert all(t is tiles[5] for t in decoding.waves(tiles, 4)[1][1])  # tile 5, then copies of it


def test_tiles_side_by_side_decode_as_one_at_a_time_one_per_chip():
    """`in_waves` stacks tiles of one shape, splits them over the chips (each call's input holds
    one tile per chip) and returns each tile's own result, in order, for tiles of several shapes."""
    mesh, seen = _decode_mesh(), []

    @jax.jit
    def decode(x):  # stands in for a decoder: per-sample work that differs by position
        return jnp.cumsum(x, axis=-1) * 2.0

    def decode_one(batch):
        seen.append((batch.shape, batch.sharding))
        return decode(batch)

    rng = np.random.default_rng(0)
    tiles = [rng.standard_normal(s).astype(np.float32) for s in [(1, 3, 5)] * 6 + [(1, 2, 5)] * 2]
    got = decoding.in_waves([jnp.asarray(t) for t in tiles], decode_one, mesh)
    for tile, out in zip(tiles, got, strict=True):
        np.testing.assert_allclose(np.asarray(out), np.cumsum(tile, axis=-1) * 2.0, rtol=1e-6)
    assert [shape for shape, _ in seen] == [(CHIPS, 3, 5), (CHIPS, 3, 5), (CHIPS, 2, 5)]
    for shape, sharding in seen:
        assert sharding.shard_shape(shape) == (1, *shape[1:])  # one tile per chip
        assert sharding.device_set == set(mesh.devices.flat)


def test_the_decode_mesh_is_this_processs_chips_of_the_mesh():
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    chips = decoding.decode_mesh(mesh)
    assert chips.axis_names == (decoding.AXIS,) and chips.size == len(jax.local_devices()) == 8


def _spec(tree):
    """Shapes and dtypes, no sharding, as a hashable key."""
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(tree)]
    return jax.tree.structure(tree), tuple(leaves)


def _cogvideox_decode_calls(monkeypatch, tiling: bool) -> tuple[Counter, dict, int]:
    """The tiny NNX VAE (converted from diffusers, as the pipeline loads it) decoding latents, every
    call of its jitted `_jit_apply` recorded: `{(chunk, cache) spec: calls}`, each spec's output
    spec, and the VAE's parameter bytes. The decode runs under `jax.eval_shape`: the model's own
    loop over frame batches and tiles, traced, without compiling the chunks for the CPU."""
    from diffusers import AutoencoderKLCogVideoX
    from flax import nnx

    from tpupedia.models import cogvideox_vae
    from tpupedia.models import cogvideox_vae_convert as convert

    torch.manual_seed(0)
    torch_vae = AutoencoderKLCogVideoX(**COG_CONFIG).eval()
    torch_vae.enable_tiling() if tiling else torch_vae.disable_tiling()
    vae = convert.from_diffusers(torch_vae, dtype=jnp.bfloat16)
    calls, outputs = Counter(), {}
    real = cogvideox_vae._jit_apply

    def recording(graphdef, method, state, chunk, cache, spatial=None):
        out = real(graphdef, method, state, chunk, cache, spatial=spatial)
        key = _spec((chunk, cache))
        calls[key] += 1
        outputs[key] = _spec(out)
        return out

    monkeypatch.setattr(cogvideox_vae, "_jit_apply", recording)
    frames, height, width = COG_LATENTS
    z = jax.ShapeDtypeStruct((1, COG_CONFIG["latent_channels"], frames, height // 8, width // 8), jnp.float32)
    mesh = _decode_mesh()  # as the pipeline decodes: tiles side by side, or the whole latent split
    video = jax.eval_shape(functools.partial(vae.decode, tiles=functools.partial(decoding.in_waves, mesh=None, chips=CHIPS),
                                             spatial=decoding.activation_sharding(mesh, (height // 8, width // 8))), z)
    assert video.shape == (1, 3, 4 * (frames - 1) + 1, height, width)
    return calls, outputs, sum(a.nbytes for a in jax.tree.leaves(nnx.state(vae)))


@pytest.mark.parametrize("tiling", [False, True], ids=["untiled", "tiled"])
def test_cogvideox_programs_are_the_decode_calls(monkeypatch, tiling):
    programs = cog_pipeline.decode_programs(COG_CONFIG, *COG_LATENTS, _decode_mesh(), tiling=tiling)
    calls, outputs, weights = _cogvideox_decode_calls(monkeypatch, tiling)
    got = Counter({_spec(p.args[1:]): p.calls for p in programs})
    assert got == calls
    assert len(programs) == len(calls) == (8 if tiling else 2)  # 4 tile shapes x (first, later batches)
    for p in programs:
        assert p.stage == "decode" and p.weights_bytes == weights
        if tiling:  # one tile per chip
            assert p.args[1].shape[0] == CHIPS and p.args[1].sharding.shard_shape(p.args[1].shape)[0] == 1
        else:  # the whole latent on every chip, each computing a quarter of the height (8 latent rows / 4)
            assert p.args[1].shape[0] == 1 and "split by height over 4 chips" in p.name
            assert tuple(p.fn.keywords["spatial"].spec) == (None, None, decoding.AXIS, None, None)
        assert _spec(jax.eval_shape(p.fn, *p.args)) == outputs[_spec(p.args[1:])]
        assert ("causal cache" in p.name) == (p.args[2] is not None)
        assert ("tiles" in p.name) == tiling


def test_a_whole_latent_split_over_chips_is_split_by_the_pins_inside_the_vae(monkeypatch):
    """The untiled CogVideoX decode hands every chip the whole latent, so the activation pins
    inside the VAE (`cogvideox_vae._spatial`) are what splits it: with them removed, the pipeline's
    first-batch program over 4 chips holds on each chip what it holds on one chip alone (CPU
    compiles, per-device temporaries). That with the pins each chip holds under a third of one
    chip's is notebook `cogvideox_pipeline`'s assert (the same program over the host's chips)."""
    from tpupedia.models import cogvideox_vae

    def temporaries(chips):
        mesh = devices.make_mesh((chips,), (decoding.AXIS,), devices=jax.devices()[:chips])
        (first, *_) = cog_pipeline.decode_programs(cogvideox.tiny_vae_config(), 3, 128, 192, mesh, dtype="bfloat16")
        result = first.compile()
        assert result.fits, result.summary()
        return result.memory.temporaries

    one = temporaries(1)
    monkeypatch.setattr(cogvideox_vae, "_spatial", lambda x: x)  # no pins
    cogvideox_vae._jit_apply.clear_cache()
    assert temporaries(4) > one * 0.9


def _hunyuan_decode_calls(tiling: bool):
    """Stock diffusers' decode of latents by the tiny VAE, its decoder wrapped to record each call's
    input and output shape: `{input shape: calls}`, `{input shape: output shape}` and the decoder.
    The stock VAE (as diffusers builds it from the config, nothing of ours applied) runs on PyTorch's
    `meta` device: the same code, tiling and blending included, on tensors that have shapes and no
    data, so the calls and shapes are the real decode's without computing it."""
    from diffusers import AutoencoderKLHunyuanVideo15

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo15(**hunyuan.tiny_vae_config()).eval()
    decoder, calls, outputs = vae.decoder, Counter(), {}

    class Recording(torch.nn.Module):
        def forward(self, z):
            out = decoder(z)
            calls[tuple(z.shape)] += 1
            outputs[tuple(z.shape)] = tuple(out.shape)
            return out

    vae.decoder = Recording()
    vae.enable_tiling() if tiling else vae.disable_tiling()
    frames, height, width = HY_LATENTS
    z = torch.empty(1, hunyuan.tiny_vae_config()["latent_channels"], frames, height // 16, width // 16, device="meta")
    with torch.no_grad():
        video = vae.decode(z).sample
    assert tuple(video.shape) == (1, 3, 4 * (frames - 1) + 1, height, width) and video.is_meta
    return calls, outputs, decoder


@pytest.mark.parametrize("tiling", [False, True], ids=["untiled", "tiled"])
def test_hunyuan_programs_are_the_decoder_calls(tiling):
    """`decode_programs` lists one program per distinct input shape of the decoder calls stock
    diffusers' decode makes (recorded on `meta`), tiled and untiled: each with that input shape one
    piece per chip, the waves of those calls as its count, the decoder's output shape, and the
    decoder's weight bytes."""
    calls, outputs, decoder = _hunyuan_decode_calls(tiling)
    programs = hy_pipeline.decode_programs(hunyuan.tiny_vae_config(), *HY_LATENTS, _decode_mesh(),
                                         dtype="float32", tiling=tiling)
    got = Counter({tuple(p.args[2].shape): p.calls for p in programs})
    waves = Counter({(CHIPS, *shape[1:]): -(-n // CHIPS) for shape, n in calls.items()})  # tiles per chip per shape
    assert got == waves
    assert len(programs) == (4 if tiling else 1)
    weights = sum(t.numel() * t.element_size() for t in decoder.parameters())
    for p in programs:
        assert p.stage == "decode" and p.weights_bytes == weights and p.args[2].dtype == jnp.float32
        out = jax.eval_shape(p.fn, *p.args)
        one = outputs[(1, *p.args[2].shape[1:])]
        assert (tuple(out.shape), out.dtype) == ((CHIPS, *one[1:]), jnp.float32)
        assert ("tiles" in p.name) == tiling


def test_hunyuan_program_computes_the_decoder():
    """Given the real weights, the program (jitted for the CPU) computes diffusers' decoder."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    decoder = AutoencoderKLHunyuanVideo15(**hunyuan.tiny_vae_config()).eval().decoder
    one_chip = devices.make_mesh((1,), (decoding.AXIS,), devices=jax.devices()[:1])
    (program,) = hy_pipeline.decode_programs(hunyuan.tiny_vae_config(), 1, 32, 48, one_chip, dtype="float32")
    params = {name: jnp.asarray(t.detach().numpy()) for name, t in decoder.named_parameters()}
    z = torch.randn(program.args[2].shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = decoder(z).numpy()
    got = np.asarray(jax.jit(program.fn)(params, {}, jnp.asarray(z.numpy())))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not devices.has_libtpu(), reason="libtpu not installed (pip install 'jax[tpu]')")
def test_a_tiny_program_compiles_for_a_v6e_chip():
    host = devices.make_mesh((4,), (decoding.AXIS,), devices=devices.tpu_topology("v6e:2x4")[:4])  # a host's chips
    program = cog_pipeline.decode_programs(cogvideox.tiny_vae_config(), 1, 8, 8, host)[0]
    result = program.compile()
    assert result.fits, result.summary()
    assert result.memory.arguments >= program.weights_bytes > 0


PROGRAMS = {"cogvideox": (cog_pipeline.decode_programs, cogvideox.tiny_vae_config()),
            "hunyuan": (hy_pipeline.decode_programs, hunyuan.tiny_vae_config())}


@pytest.mark.parametrize("family, size, words", [
    ("cogvideox", (0, 64, 64), ["latent_frames=0", "1 or more"]),
    ("cogvideox", (2, 60, 64), ["height=60", "multiple of 8"]),
    ("cogvideox", (2, 64, -8), ["width=-8", "positive multiple of 8"]),
    ("hunyuan", (0, 64, 64), ["latent_frames=0", "1 or more"]),
    ("hunyuan", (2, 72, 64), ["height=72", "multiple of 16"]),  # fine for CogVideoX's 8x, not for 16x
    ("hunyuan", (2, 64, 64.0), ["width=64.0", "multiple of 16"]),
])
def test_bad_input_names_the_value_and_what_is_allowed(family, size, words):
    programs, config = PROGRAMS[family]
    with pytest.raises(PipelineError) as err:
        programs(config, *size, _decode_mesh())
    assert all(w in str(err.value) for w in words), str(err.value)
