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

A decode is not one program. CogVideoX's Flax NNX VAE (notebook `cogvideox_vae_flax`) decodes two latent frames at a
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

Introduced in notebooks `cogvideox_pipeline` and `hunyuan_video` (the decode stages); `tpupedia plan` compiles the programs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpupedia import aot
from tpupedia.pipelines.common import PipelineError

__all__ = ["decode_mesh", "activation_sharding", "waves", "in_waves", "check_decode", "where", "replicated",
           "spread", "nbytes", "STAGE", "AXIS"]

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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

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
    (`tpupedia.models.cogvideox_vae`); the HunyuanVideo-1.5 decode (and image-to-video's encode) use it through `tpupedia.pipelines.hunyuan.through_tiles`.
    Introduced in notebook `cogvideox_pipeline` (the decode stage)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

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


def check_decode(family: str, latent_frames: Any, height: Any, width: Any, ratio: int) -> None:
    """Refuse a decode the VAE cannot run, naming the bad value and what is allowed."""
    if not isinstance(latent_frames, int) or isinstance(latent_frames, bool) or latent_frames < 1:
        raise PipelineError(f"latent_frames={latent_frames!r}: the {family} VAE decodes a positive whole number "
                            "of latent frames (1 or more)")
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % ratio:
            raise PipelineError(f"{name}={value!r}: the {family} VAE compresses {ratio}x in space, so the video "
                                f"{name} must be a positive multiple of {ratio}")


def nbytes(tree: Any) -> int:
    import jax

    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def replicated(mesh: Any, tree: Any) -> Any:
    """`tree`'s arrays (shapes and dtypes) as abstract arguments, a whole copy on every chip of `mesh`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, NamedSharding(mesh, P())), tree)


def spread(mesh: Any, tree: Any) -> Any:
    """`tree`'s arrays as abstract arguments split on axis 0 over `mesh`: one tile per chip; `None` stays."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, NamedSharding(mesh, P(AXIS))), tree)


def where(chips: int, h: int, w: int, latent_hw: tuple[int, int], split: Any = None, unit: str = "latent") -> str:
    """Where a decoder call's pieces go, in words (a program's name in a plan); `unit="pixel"`
    for an encoder's."""
    if (h, w) == latent_hw:
        if split is not None:
            axis = "width" if split.spec[3] else "height"
            return f"{h}x{w} {unit}s split by {axis} over {split.mesh.size} chips"
        return f"{h}x{w} {unit}s, " + ("a copy on each chip" if chips > 1 else "one chip")
    return f"{h}x{w}-{unit} tiles, " + (f"{chips} side by side, one per chip" if chips > 1 else "one at a time")
