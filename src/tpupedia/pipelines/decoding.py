"""The decode stage spread over a host's chips, and the programs it runs, for `tpupedia.plan`.

A causal video VAE cannot be split in time: each frame batch needs the previous one's
causal-convolution cache. It can be split in space, two ways, so that a host's chips share the
decode instead of one working while the others wait:

- with tiling, the tiles are independent until diffusers blends their seams: tiles of one shape
  are stacked on the batch axis and decoded side by side, one per chip (`in_waves`; each tile is
  computed as alone, a VAE normalises per sample), and the frames are still diffusers' tiled frames;
- without, CogVideoX's Flax VAE splits every activation of the whole latent by width or height
  (`activation_sharding`): each chip computes its strip and trades edges with its neighbours,
  and the frames are the untiled frames. (HunyuanVideo-1.5's untiled decode, diffusers' modules
  under torchax, is one piece given to every chip; at 720p it does not fit a chip and the plan
  tiles it.)

A decode is not one program. CogVideoX's Flax NNX VAE (notebook 05) decodes two latent frames at a
time and carries the cache from one frame batch to the next, so a run compiles one program for the
first batch (no cache, and the odd extra frame) and one for the later batches; with tiling, one
such pair per distinct tile shape. HunyuanVideo-1.5's VAE (diffusers under torchax) decodes all
latent frames in one call, or one call per spatial tile. Which decoder calls happen, and with which
shapes, is read from the real decode code run on shapes only (`jax.eval_shape` for the NNX port,
PyTorch's `meta` device for diffusers), so a change upstream changes the programs; nothing here
re-derives the VAE's arithmetic. Each program is compiled through the function the pipeline jits,
with the VAE's weights as abstract arguments replicated on the host's chips and one tile per chip,
so an ahead-of-time compile for a TPU says what each decoder call needs there: whether 720p fits
untiled, and what tiling saves.

Introduced in notebooks 06 and 07 (the decode stages); `tpupedia plan` compiles the programs.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

from tpupedia import aot
from tpupedia.pipelines.common import PipelineError

__all__ = ["decode_mesh", "activation_sharding", "waves", "in_waves", "hunyuan_decode", "meta_decoder",
           "cogvideox_programs", "hunyuan_programs"]

STAGE = "decode"
AXIS = "tiles"
"""The one axis of the decode mesh, a host's chips: a wave's tiles, or an activation's strips."""


# --- spreading a decode over a host's chips -----------------------------------------------------

def decode_mesh(mesh: Any) -> Any:
    """The chips a decode stage uses: `mesh`'s devices on this process, as a one-axis mesh
    (`AXIS`). In a multi-host job each host decodes on its own chips and the hosts never talk
    (there is nothing to exchange), so a host is the unit; for a TPU topology described ahead
    of time (`tpupedia.plan`) it is the first host's chips."""
    import jax

    from tpupedia import devices

    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return devices.make_mesh((len(mine),), (AXIS,), devices=mine)


def activation_sharding(mesh: Any, latent_hw: tuple[int, int]) -> Any:
    """How a whole latent's decode splits its (B, T, H, W, C) activations over the chips of `mesh`
    (`cogvideox_vae.AutoencoderKLCogVideoX.decode(spatial=...)`): along the width, as upstream
    constrains its VAE, when the latent width divides among the chips, else along the height when
    that divides; every upsampled size then divides too. `None` (each chip decodes the whole
    latent) for one chip, or when neither divides: an uneven split breaks GroupNorm's reshape
    when a strip would be narrower than a latent pixel."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    h, w = latent_hw
    if mesh.size == 1 or (w % mesh.size and h % mesh.size):
        return None
    axis = 3 if w % mesh.size == 0 else 2
    return NamedSharding(mesh, P(*(AXIS if i == axis else None for i in range(5))))


def waves(pieces: list, chips: int) -> list[tuple[list[int], list]]:
    """How `in_waves` runs `pieces` on `chips`: pieces of one shape (shapes in order of first
    appearance) in waves of `chips`, the last wave of a shape filled up with copies of its last
    piece (a chip with no piece of its own decodes a copy, which is dropped), as
    `[(the wave's piece indices, its `chips` pieces)]`. Shapes only: works on abstract arrays."""
    groups: dict[tuple, list[int]] = {}
    for i, piece in enumerate(pieces):
        groups.setdefault(tuple(piece.shape), []).append(i)
    out = []
    for index in groups.values():
        for start in range(0, len(index), chips):
            part = index[start:start + chips]
            out.append((part, [pieces[i] for i in part] + [pieces[part[-1]]] * (chips - len(part))))
    return out


def in_waves(pieces: list, decode_one: Callable[[Any], Any], mesh: Any = None, *, chips: int | None = None) -> list:
    """Decode `pieces` (arrays with a batch axis 0 of size 1, of a few shapes) side by side:
    each wave (`waves`) is stacked on axis 0, split over the chips of `mesh` (a `decode_mesh`,
    one piece per chip) and decoded by one call of `decode_one`; returns the decoded pieces in
    order, on the default device, ready to blend. A chip holds one piece's activations at a time,
    as when the pieces run one after another on one chip.

    Without `mesh` nothing is placed (`chips` pieces a wave): how `tpupedia.plan` traces the same
    waves on shapes only (`jax.eval_shape`). The `TileRunner` of the Flax VAE
    (`tpupedia.models.cogvideox_vae`); the HunyuanVideo-1.5 decode uses it through `hunyuan_decode`.
    Introduced in notebook 06 (the decode stage)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    chips = mesh.size if mesh is not None else chips
    out: list = [None] * len(pieces)
    for index, wave in waves(pieces, chips):
        if mesh is None:
            decoded = decode_one(jnp.concatenate(wave, axis=0))
            for k, i in enumerate(index):
                out[i] = decoded[k:k + 1]
            continue
        batch = jax.device_put(np.concatenate([np.asarray(p) for p in wave], axis=0), NamedSharding(mesh, P(AXIS)))
        decoded = np.asarray(jax.device_get(decode_one(batch)))
        for k, i in enumerate(index):
            out[i] = jnp.asarray(decoded[k:k + 1])
    return out


def hunyuan_decode(vae: Any, z: Any, mesh: Any, env: Any, shapes_of: Any) -> Any:
    """HunyuanVideo-1.5's `vae.decode(z).sample` (z: CPU torch latents, `vae` a diffusers
    `AutoencoderKLHunyuanVideo15` whose `decoder` is jitted under torchax and replicated over
    `mesh`), with its decoder calls run side by side on `mesh` (`in_waves`). Returns CPU torch.
    `shapes_of` is the decoder on PyTorch's `meta` device (`meta_decoder`): what a tile decodes to.

    diffusers' own `decode` runs twice around the real work, so the tiling, blending and cropping
    are stock code: first with a decoder that only records each tile it is given (answering with
    an empty `meta` tensor of the decoded shape), then, once the recorded tiles are decoded in
    waves, with a decoder that hands back those results in order. The blending runs on the host,
    in the VAE's dtype, as diffusers runs it. Introduced in notebook 07 (the decode stage)."""
    import torch
    from torchax.interop import jax_view, torch_view

    from tpupedia.pipelines import common

    jitted, tiles = vae.decoder, []

    def record(tile):
        tiles.append(tile)
        dtype = next(shapes_of.parameters()).dtype
        with torch.no_grad():
            return shapes_of(torch.empty(tile.shape, dtype=dtype, device="meta"))

    def decode_one(batch):
        with env:
            return jax_view(jitted(torch_view(batch)))

    try:
        vae.decoder = _calls(record)
        with torch.no_grad():
            vae.decode(z)
        decoded = iter(in_waves([common.to_jax_array(t) for t in tiles], decode_one, mesh))
        vae.decoder = _calls(lambda tile: common.to_torch(next(decoded)))
        with torch.no_grad():
            return vae.decode(z).sample
    finally:
        vae.decoder = jitted


def _calls(fn: Callable[[Any], Any]) -> Any:
    """A module whose forward is `fn`: what stands in for a VAE's `decoder` (`hunyuan_decode`)."""
    import torch

    class Calls(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    return Calls()


def meta_decoder(vae_config: dict) -> Any:
    """HunyuanVideo-1.5's VAE decoder built on PyTorch's `meta` device from the checkpoint's VAE
    config (shapes only, the mid-block's loop-free mask), in eval mode."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    from tpupedia.models import hunyuan

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo15.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    return hunyuan.make_vae_jit_friendly(vae).decoder.eval()


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


def _replicated(mesh: Any, tree: Any) -> Any:
    """`tree`'s arrays (shapes and dtypes) as abstract arguments, a whole copy on every chip of `mesh`."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, NamedSharding(mesh, P())), tree)


def _spread(mesh: Any, tree: Any) -> Any:
    """`tree`'s arrays as abstract arguments split on axis 0 over `mesh`: one tile per chip; `None` stays."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, NamedSharding(mesh, P(AXIS))), tree)


# --- CogVideoX: the Flax NNX VAE, frame batch by frame batch ------------------------------------

def _chunk_calls(graphdef: Any, state: Any, latents: Any, chips: int, spatial: Any) -> dict[tuple, list]:
    """Every `decode_chunk` call of the model's own `decode` on `latents` (channels-first, abstract)
    with its pieces in waves of `chips` (`in_waves`, as the pipeline runs it), grouped by abstract
    arguments: `{key: [calls, chunk latents, cache]}` in order of first call.

    `decode` runs under `jax.eval_shape` with its runner swapped for one that records each
    call's arguments and then calls the model's jitted `_jit_apply`, so repeated shapes trace once.
    """
    import jax
    from flax import nnx

    from tpupedia.models import cogvideox_vae

    calls: dict[tuple, list] = {}

    def decode(st, z):
        def runner(method, jit, split=None):
            def run(chunk, cache):
                args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (chunk, cache))
                key = (jax.tree.structure(args), tuple(jax.tree.leaves(args)))
                calls.setdefault(key, [0, *args, split])[0] += 1
                return cogvideox_vae._jit_apply(graphdef, "decode_chunk", st, chunk, cache, spatial=split)

            return run

        model = nnx.merge(graphdef, st)
        model._runner = runner
        return model.decode(z, tiles=functools.partial(in_waves, chips=chips), spatial=spatial)

    jax.eval_shape(decode, state, latents)
    return calls


def _where(chips: int, h: int, w: int, latent_hw: tuple[int, int], split: Any = None) -> str:
    if (h, w) == latent_hw:
        if split is not None:
            axis = "width" if split.spec[3] else "height"
            return f"{h}x{w} latents split by {axis} over {split.mesh.size} chips"
        return f"{h}x{w} latents, " + ("a copy on each chip" if chips > 1 else "one chip")
    return f"{h}x{w}-latent tiles, " + (f"{chips} side by side, one per chip" if chips > 1 else "one at a time")


def _chunk_name(chunk: Any, cached: bool, calls: int, latent_hw: tuple[int, int], split: Any, chips: int) -> str:
    _, frames, h, w, _ = chunk.shape  # channels-last inside the NNX VAE
    batch = "later frame batches, with the causal cache" if cached else "first frame batch"
    return f"VAE decode, {batch} ({frames} latent frames, {_where(chips, h, w, latent_hw, split)}, x {calls})"


def cogvideox_programs(vae_config: dict, latent_frames: int, height: int, width: int, mesh: Any, *,
                       dtype: Any = "bfloat16", tiling: bool = False) -> list[aot.Program]:
    """The decoder programs of CogVideoX's `decode` stage (`vae="flax"`) for a `height` x `width`
    video decoded from `latent_frames` latent frames (the padding frames already dropped), on the
    chips of `mesh` (a `decode_mesh`).

    `vae_config` is the checkpoint's VAE config dict (diffusers' `AutoencoderKLCogVideoX` fields);
    the weights are abstract, in `dtype`, a copy on every chip. One program per distinct
    `decode_chunk` call: the first frame batch, the later ones with the cache, per tile shape with
    `tiling` (diffusers' `enable_tiling` defaults), each taking one piece per chip; `calls` counts
    each (waves of tiles times frame batches). Raises `PipelineError` for frames < 1 or sizes that
    are not multiples of the VAE's spatial compression.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

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
    calls = _chunk_calls(graphdef, state, latents, mesh.size, activation_sharding(mesh, latent_hw))
    state = _replicated(mesh, state)
    weights = _nbytes(state)

    def arguments(chunk, cache, split):  # a wave of tiles: one per chip; a whole latent: on every chip
        if split is None and chunk.shape[0] == mesh.size:
            return _spread(mesh, chunk), _spread(mesh, cache)
        cached = split if split is not None else NamedSharding(mesh, P())  # the cache as the last call left it
        return _replicated(mesh, chunk), jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, cached), cache)

    return [aot.Program(STAGE, _chunk_name(chunk, cache is not None, n, latent_hw, split, mesh.size),
                        functools.partial(cogvideox_vae._jit_apply, graphdef, "decode_chunk", spatial=split),  # `_runner`'s
                        (state, *arguments(chunk, cache, split)), weights_bytes=weights, calls=n, component="vae")
            for n, chunk, cache, split in calls.values()]


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
    chips, _, frames, h, w = shape
    return f"VAE decode, all {frames} latent frames at once ({_where(chips, h, w, latent_hw)}, x {calls})"


def hunyuan_programs(vae_config: dict, latent_frames: int, height: int, width: int, mesh: Any, *,
                     dtype: Any = "bfloat16", tiling: bool = False) -> list[aot.Program]:
    """The decoder programs of HunyuanVideo-1.5's `decode` stage for a `height` x `width` video
    decoded from `latent_frames` latent frames (`latent_shape(...)[2]`), on the chips of `mesh` (a
    `decode_mesh`).

    `vae_config` is the checkpoint's VAE config dict (`AutoencoderKLHunyuanVideo15` fields; missing
    ones take diffusers' defaults, the release's: `models.hunyuan.full_configs()["vae"]`). The VAE
    is built on `meta`, its decoder's weights become abstract arguments in `dtype`, a copy on every
    chip. One program per distinct decoder input shape, one piece per chip: the whole latent
    untiled, each distinct spatial tile with `tiling` (`calls` counts the waves of tiles,
    `hunyuan_decode`). Raises `PipelineError` for frames < 1 or sizes that are not multiples of the
    VAE's spatial compression.

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
    chips = mesh.size
    calls = {(chips, *shape[1:]): len(waves([jax.ShapeDtypeStruct(shape, dtype)] * n, chips))
             for shape, n in _decoder_calls(vae, latents).items()}
    env = torchax_utils.default_env()  # imports torchax through the compatibility shim
    fm = torchax_utils.FunctionalModule(vae.decoder)  # what `JitModule(vae.decoder)` calls
    state = _replicated(mesh, fm.abstract_state())
    weights = _nbytes(state)
    decode = _reference_attention(fm, env)
    return [aot.Program(STAGE, _decoder_name(shape, n, latent_hw), decode,
                        (*state, _spread(mesh, jax.ShapeDtypeStruct(shape, dtype))), weights_bytes=weights, calls=n, component="vae")
            for shape, n in calls.items()]
