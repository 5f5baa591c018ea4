"""The programs a pipeline's decode stage runs, as `aot.Program`s with abstract weights.

A VAE decode is not one program. CogVideoX's Flax NNX VAE (notebook 05) decodes two latent
frames at a time and carries a causal-convolution cache from one frame batch to the next, so a
run compiles one program for the first batch (no cache, and the odd extra frame) and one for the
later batches; with tiling, one such pair per distinct tile shape. HunyuanVideo-1.5's VAE
(diffusers under torchax) decodes all latent frames in one call, or one call per spatial tile.
Which decoder calls happen, and with which shapes, is read from the real decode code run on
shapes only (`jax.eval_shape` for the NNX port, PyTorch's `meta` device for diffusers), so a
change upstream changes the programs; nothing here re-derives the VAE's arithmetic. Each program
is compiled through the same function the pipeline jits, with the VAE's weights as abstract
arguments on one chip (the pipelines decode on one device), so an ahead-of-time compile for a
TPU says what each decoder call needs there: whether 720p fits untiled, and what tiling saves.

Introduced in notebook 06/07 (decode stages); `tpupedia plan` compiles them.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from tpupedia import aot
from tpupedia.pipelines.common import PipelineError

__all__ = ["cogvideox_programs", "hunyuan_programs"]

STAGE = "decode"


def _check(family: str, latent_frames: Any, height: Any, width: Any, ratio: int) -> None:
    """Refuse a decode the VAE cannot run, naming the bad value and what is allowed."""
    if not isinstance(latent_frames, int) or isinstance(latent_frames, bool) or latent_frames < 1:
        raise PipelineError(f"latent_frames={latent_frames!r}: the {family} VAE decodes a positive whole number "
                            "of latent frames (1 or more)")
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % ratio:
            raise PipelineError(f"{name}={value!r}: the {family} VAE compresses {ratio}x in space, so the video "
                                f"{name} must be a positive multiple of {ratio}")


def _nbytes(tree: Any) -> int:
    import jax

    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _on(device: Any, tree: Any) -> Any:
    """`tree`'s arrays (shapes and dtypes) as abstract arguments on `device`; `None` stays `None`."""
    import jax
    from jax.sharding import SingleDeviceSharding

    chip = SingleDeviceSharding(device)
    return jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, chip), tree)


# --- CogVideoX: the Flax NNX VAE, frame batch by frame batch ------------------------------------

def _chunk_calls(graphdef: Any, state: Any, latents: Any) -> dict[tuple, list]:
    """Every `decode_chunk` call of the model's own `decode` on `latents` (channels-first, abstract),
    grouped by abstract arguments: `{key: [calls, chunk latents, cache]}` in order of first call.

    `decode` runs under `jax.eval_shape` with its runner swapped for one that records each
    call's arguments and then calls the model's jitted `_jit_apply`, so repeated shapes trace once.
    """
    import jax
    from flax import nnx

    from tpupedia.models import cogvideox_vae

    calls: dict[tuple, list] = {}

    def decode(st, z):
        def run(chunk, cache):
            args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (chunk, cache))
            key = (jax.tree.structure(args), tuple(jax.tree.leaves(args)))
            calls.setdefault(key, [0, *args])[0] += 1
            return cogvideox_vae._jit_apply(graphdef, "decode_chunk", st, chunk, cache)

        model = nnx.merge(graphdef, st)
        model._runner = lambda method, jit: run
        return model.decode(z)

    jax.eval_shape(decode, state, latents)
    return calls


def _chunk_name(chunk: Any, cached: bool, calls: int, latent_hw: tuple[int, int]) -> str:
    _, frames, h, w, _ = chunk.shape  # channels-last inside the NNX VAE
    where = f"{h}x{w}-latent tiles" if (h, w) != latent_hw else f"{h}x{w} latents"
    batch = "later frame batches, with the causal cache" if cached else "first frame batch"
    return f"VAE decode, {batch} ({frames} latent frames, {where}, x {calls})"


def cogvideox_programs(vae_config: dict, latent_frames: int, height: int, width: int, device: Any, *,
                       dtype: Any = "bfloat16", tiling: bool = False) -> list[aot.Program]:
    """The decoder programs of CogVideoX's `decode` stage (`vae="flax"`) for a `height` x `width`
    video decoded from `latent_frames` latent frames (the padding frames already dropped).

    `vae_config` is the checkpoint's VAE config dict (diffusers' `AutoencoderKLCogVideoX` fields);
    the weights are abstract, in `dtype`, on `device`. One program per distinct `decode_chunk`
    call: the first frame batch, the later ones with the cache, per tile shape with `tiling`
    (diffusers' `enable_tiling` defaults); `calls` counts each. Raises `PipelineError` for
    frames < 1 or sizes that are not multiples of the VAE's spatial compression.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tpupedia.models import cogvideox_vae
    from tpupedia.models import cogvideox_vae_convert as convert

    config = cogvideox_vae.CogVideoXVAEConfig.from_dict(vae_config)
    ratio = config.spatial_compression_ratio
    _check("CogVideoX", latent_frames, height, width, ratio)
    dtype = jnp.dtype(dtype)
    model = convert.abstract_vae(config, dtype=dtype, param_dtype=dtype)
    model.enable_tiling() if tiling else model.disable_tiling()
    graphdef, state = nnx.split(model)
    latent_hw = (height // ratio, width // ratio)
    latents = jax.ShapeDtypeStruct((1, config.latent_channels, latent_frames, *latent_hw), dtype)
    calls = _chunk_calls(graphdef, state, latents)
    state = _on(device, state)
    weights = _nbytes(state)
    decode_chunk = functools.partial(cogvideox_vae._jit_apply, graphdef, "decode_chunk")  # what `_runner` jits
    return [aot.Program(STAGE, _chunk_name(chunk, cache is not None, n, latent_hw), decode_chunk,
                        (state, _on(device, chunk), _on(device, cache)), weights_bytes=weights, calls=n)
            for n, chunk, cache in calls.values()]


# --- HunyuanVideo-1.5: diffusers' VAE under torchax, all frames at once --------------------------

def _decoder_calls(vae: Any, latents: Any) -> Counter:
    """How often diffusers' `vae.decode(latents)` calls `vae.decoder`, per input shape, run on `meta`."""
    import torch

    calls: Counter = Counter()
    hook = vae.decoder.register_forward_pre_hook(lambda _module, args: calls.update([tuple(args[0].shape)]))
    try:
        with torch.no_grad():
            vae.decode(latents)
    finally:
        hook.remove()
    return calls


def _reference_attention(fm: Any, env: Any):
    """`fm(params, buffers, z)` traced with torchax's own SDPA (the pipeline's decode installs none;
    the environment is shared, so it is left as found)."""
    from tpupedia import torchax_utils

    def decode(params, buffers, z):
        with torchax_utils.restoring_ops(env):
            torchax_utils.stock_ops(env)
            return fm(params, buffers, z)

    return decode


def _decoder_name(shape: tuple[int, ...], calls: int, latent_hw: tuple[int, int]) -> str:
    _, _, frames, h, w = shape
    where = f"{h}x{w}-latent tiles" if (h, w) != latent_hw else f"{h}x{w} latents"
    return f"VAE decode, all {frames} latent frames at once ({where}, x {calls})"


def hunyuan_programs(vae_config: dict, latent_frames: int, height: int, width: int, device: Any, *,
                     dtype: Any = "bfloat16", tiling: bool = False) -> list[aot.Program]:
    """The decoder programs of HunyuanVideo-1.5's `decode` stage for a `height` x `width` video
    decoded from `latent_frames` latent frames (`latent_shape(...)[2]`).

    `vae_config` is the checkpoint's VAE config dict (`AutoencoderKLHunyuanVideo15` fields; missing
    ones take diffusers' defaults, the release's: `models.hunyuan.full_configs()["vae"]`). The VAE
    is built on `meta`, its decoder's weights become abstract arguments in `dtype` on `device`. One
    program per distinct decoder input shape: the whole latent untiled, each distinct spatial tile
    with `tiling` (`calls` counts tiles). Raises `PipelineError` for frames < 1 or sizes that are
    not multiples of the VAE's spatial compression.

    `weights_bytes` is the decoder's weights (its arguments); the pipeline also keeps the encoder
    on the chip. The mid-block attention gets the pipeline's loop-free causal mask
    (`models.hunyuan.make_vae_jit_friendly`).
    """
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    from tpupedia import torchax_utils
    from tpupedia.models import hunyuan

    with torch.device("meta"):  # shapes only, and the config as diffusers reads it (defaults filled in)
        vae = AutoencoderKLHunyuanVideo15.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    ratio = vae.spatial_compression_ratio
    _check("HunyuanVideo-1.5", latent_frames, height, width, ratio)
    dtype = jnp.dtype(dtype)
    torch_dtype = getattr(torch, dtype.name)
    vae = hunyuan.make_vae_jit_friendly(vae.to(torch_dtype).eval())
    vae.enable_tiling() if tiling else vae.disable_tiling()  # as the pipeline's `_decode`
    latent_hw = (height // ratio, width // ratio)
    latents = torch.empty((1, vae.config.latent_channels, latent_frames, *latent_hw), dtype=torch_dtype, device="meta")
    calls = _decoder_calls(vae, latents)
    env = torchax_utils.default_env()  # imports torchax through the compatibility shim
    fm = torchax_utils.FunctionalModule(vae.decoder)  # what `JitModule(vae.decoder)` calls
    state = _on(device, fm.abstract_state())
    weights = _nbytes(state)
    decode = _reference_attention(fm, env)
    return [aot.Program(STAGE, _decoder_name(shape, n, latent_hw), decode,
                        (*state, _on(device, jax.ShapeDtypeStruct(shape, dtype))), weights_bytes=weights, calls=n)
            for shape, n in calls.items()]
