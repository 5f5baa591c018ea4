"""The CogVideoX VAE (`diffusers.AutoencoderKLCogVideoX`) as a Flax NNX module.

Introduced in notebook `cogvideox_vae_flax` (CogVideoX VAE in Flax NNX).

The port follows diffusers 0.42 operation by operation, so that with the same weights it agrees
with PyTorch at float32 rounding level (tests/test_cogvideox_vae.py checks max abs error <= 1e-4
on several configs, tiled and untiled). Two choices differ from PyTorch on purpose:

* **Channels-last inside, channels-first at the boundary.** `encode` takes video as
  `(B, C, T, H, W)` and returns moments in the same layout; `decode` takes and returns
  `(B, C, T, H, W)`, exactly like diffusers. Everything between the two transposes is
  `(B, T, H, W, C)`, the layout XLA's TPU convolutions prefer.
* **The causal-conv cache is a returned value, not hidden state.** Every module's
  `__call__(x, cache) -> (y, new_cache)` returns a nested dict keyed like diffusers'
  `conv_cache`, so one frame batch is a pure function that can be jitted on its own, while the
  loop over frame batches and tiles stays in Python (jitting the whole loop unrolls it; see the
  notebook).

Weight conversion from a diffusers state dict or a safetensors checkpoint lives in
`tpupedia.models.cogvideox_vae_convert`; the layer-by-layer comparison tool too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpupedia.errors import TpupediaError

__all__ = [
    "CogVideoXVAEConfig",
    "VAEInputError",
    "VAEConfigError",
    "DiagonalGaussian",
    "GroupNorm",
    "CausalConv3d",
    "SpatialNorm3D",
    "ResnetBlock3D",
    "Downsample3D",
    "Upsample3D",
    "DownBlock3D",
    "MidBlock3D",
    "UpBlock3D",
    "Encoder3D",
    "Decoder3D",
    "AutoencoderKLCogVideoX",
    "frame_batches",
    "tiny_config",
    "to_channels_last",
    "to_channels_first",
]

Cache = dict[str, Any] | None


class VAEInputError(TpupediaError, ValueError):
    """An input the VAE cannot process: wrong rank, channel count or frame count."""


class VAEConfigError(TpupediaError, ValueError):
    """A configuration the port does not support (or that diffusers itself would reject)."""


# ----------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class CogVideoXVAEConfig:
    """The fields of diffusers' `AutoencoderKLCogVideoX` config that shape the network.

    Defaults are diffusers' defaults, i.e. the CogVideoX-2b/5b VAE.
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("CogVideoXDownBlock3D",) * 4
    up_block_types: tuple[str, ...] = ("CogVideoXUpBlock3D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512)
    latent_channels: int = 16
    layers_per_block: int = 3
    act_fn: str = "silu"
    norm_eps: float = 1e-6
    norm_num_groups: int = 32
    temporal_compression_ratio: int = 4
    sample_height: int = 480
    sample_width: int = 720
    scaling_factor: float = 1.15258426
    shift_factor: float | None = None
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False

    def __post_init__(self) -> None:
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [t for t in self.down_block_types if t != "CogVideoXDownBlock3D"]
        bad += [t for t in self.up_block_types if t != "CogVideoXUpBlock3D"]
        if bad:
            raise VAEConfigError(f"unsupported block types {bad}; only CogVideoXDownBlock3D/CogVideoXUpBlock3D")
        if not len(self.down_block_types) == len(self.up_block_types) == len(self.block_out_channels):
            raise VAEConfigError("down_block_types, up_block_types and block_out_channels need the same length")
        if self.act_fn not in ("silu", "swish"):
            raise VAEConfigError(f"act_fn={self.act_fn!r} is not supported; use 'silu'")
        ratio = int(self.temporal_compression_ratio)
        if ratio < 1 or ratio & (ratio - 1):
            raise VAEConfigError(f"temporal_compression_ratio={self.temporal_compression_ratio} must be a power of 2")
        object.__setattr__(self, "temporal_compression_ratio", ratio)
        widths = set(self.block_out_channels)
        bad_widths = sorted(c for c in widths if c % self.norm_num_groups)
        if bad_widths:
            raise VAEConfigError(
                f"norm_num_groups={self.norm_num_groups} does not divide channel widths {bad_widths}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CogVideoXVAEConfig:
        """From a diffusers `config.json` / `vae.config`; keys the port does not use are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})

    @property
    def spatial_compression_ratio(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


def tiny_config(**overrides: Any) -> CogVideoXVAEConfig:
    """The tiny test config of the course (diffusers' own fast-test VAE sizes), with overrides."""
    base = dict(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    base.update(overrides)
    n = len(base["block_out_channels"])
    base.setdefault("down_block_types", ("CogVideoXDownBlock3D",) * n)
    base.setdefault("up_block_types", ("CogVideoXUpBlock3D",) * n)
    return CogVideoXVAEConfig(**base)


# ----------------------------------------------------------------------------------- helpers

_capture: dict[int, str] | None = None  # id(module) -> name while compare_layers records
_records: list[tuple[str, Any]] = []


def _record(module: nnx.Module, out: jax.Array) -> None:
    """Hook point for `compare_layers`: remember a layer's output while a capture is active."""
    if _capture is not None and id(module) in _capture:
        _records.append((_capture[id(module)], out))


_split: contextvars.ContextVar = contextvars.ContextVar("activation_split", default=None)


@contextlib.contextmanager
def _splitting(sharding: Any):
    """While the decoder is traced, keep its video activations split as `sharding` says."""
    token = _split.set(sharding)
    try:
        yield
    finally:
        _split.reset(token)


def _spatial(x: jax.Array) -> jax.Array:
    """Pin a (B, T, H, W, C) activation to the split `decode(..., spatial=...)` asked for.

    Without these pins the compiler keeps most activations whole on every chip (it sees a
    replicated input and replicated weights); with them, each chip holds and computes its rows
    or columns, and a 3x3 convolution only trades one-pixel edges with its neighbours
    (collective-permutes), GroupNorm one all-reduce of its sums."""
    sharding = _split.get()
    if sharding is None or x.ndim != len(sharding.spec):
        return x
    return jax.lax.with_sharding_constraint(x, sharding)


def to_channels_last(x: jax.Array) -> jax.Array:
    """(B, C, T, H, W) -> (B, T, H, W, C)."""
    return jnp.transpose(x, (0, 2, 3, 4, 1))


def to_channels_first(x: jax.Array) -> jax.Array:
    """(B, T, H, W, C) -> (B, C, T, H, W)."""
    return jnp.transpose(x, (0, 4, 1, 2, 3))


def _resize_nearest(x: jax.Array, sizes: dict[int, int]) -> jax.Array:
    """PyTorch `F.interpolate(mode="nearest")`: output index i reads input floor(i * n_in / n_out)."""
    for axis, n_out in sizes.items():
        n_in = x.shape[axis]
        if n_out == n_in:
            continue
        if n_out % n_in == 0:
            x = jnp.repeat(x, n_out // n_in, axis=axis)
        else:
            x = jnp.take(x, (np.arange(n_out) * n_in) // n_out, axis=axis)
    return x


TileRunner = Callable[[list, Callable[[jax.Array], jax.Array]], list]
"""`tiles(pieces, decode_one) -> decoded pieces, in order`: how `decode` runs its pieces."""


def one_by_one(pieces: list, decode_one: Callable[[jax.Array], jax.Array]) -> list:
    """The default `TileRunner`: each piece decoded on its own, in order (as diffusers does)."""
    return [decode_one(p) for p in pieces]


def frame_batches(num_frames: int, batch: int) -> list[tuple[int, int]]:
    """The frame slices diffusers' `_encode`/`_decode` loop over.

    The first batch absorbs the remainder: 13 latent frames in batches of 2 give
    (0, 3), (3, 5), ..., (11, 13), so the odd "first frame" always rides with batch 0.
    """
    n = max(num_frames // batch, 1)
    rem = num_frames % batch
    return [(batch * i + (0 if i == 0 else rem), min(batch * (i + 1) + rem, num_frames)) for i in range(n)]


def _conv(in_ch, out_ch, kernel, *, strides=None, padding="VALID", dtype, param_dtype, precision, rngs):
    return nnx.Conv(
        in_ch,
        out_ch,
        kernel_size=kernel,
        strides=strides,
        padding=padding,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        rngs=rngs,
    )


# ----------------------------------------------------------------------------------- layers


class GroupNorm(nnx.Module):
    """`torch.nn.GroupNorm` for channels-last input of any rank.

    Channels are split into `num_groups` *contiguous* groups (channel c is in group
    c // (C // G)); statistics are taken over every axis except batch and group, so for video
    they span time, height, width and the channels of the group. Statistics are computed in
    float32 whatever the input dtype.
    """

    def __init__(self, num_channels: int, num_groups: int, eps: float = 1e-6, *, param_dtype=jnp.float32):
        if num_channels % num_groups:
            raise VAEConfigError(f"num_groups={num_groups} does not divide num_channels={num_channels}")
        self.num_groups = num_groups
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((num_channels,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_channels,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        g = self.num_groups
        xg = x.astype(jnp.float32).reshape(*x.shape[:-1], g, c // g)
        axes = tuple(range(1, xg.ndim - 2)) + (xg.ndim - 1,)
        mean = jnp.mean(xg, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(xg - mean), axis=axes, keepdims=True)
        y = ((xg - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        y = _spatial(y.astype(x.dtype))
        _record(self, y)
        return y


class CausalConv3d(nnx.Module):
    """`CogVideoXCausalConv3d` (pad_mode "first"/"constant"): causal in time, 'same' in space.

    Time is padded on the left only, with `kernel_t - 1` frames: copies of frame 0 for the first
    frame batch, the cached last `kernel_t - 1` frames of the previous batch's (padded) input
    afterwards. The new cache is the last `kernel_t - 1` frames of this call's padded input.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 3, *, dtype, param_dtype, precision, rngs):
        k = kernel_size
        self.time_kernel_size = k
        p = (k - 1) // 2
        self.conv = _conv(
            in_ch, out_ch, (k, k, k), padding=((0, 0), (p, p), (p, p)),
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs,
        )

    def __call__(self, x: jax.Array, cache: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        k = self.time_kernel_size
        new_cache = None
        if k > 1:
            pad = cache if cache is not None else jnp.repeat(x[:, :1], k - 1, axis=1)
            x = _spatial(jnp.concatenate([pad.astype(x.dtype), x], axis=1))
            new_cache = x[:, -(k - 1):]
        y = _spatial(self.conv(x))
        _record(self, y)
        return y, new_cache


class SpatialNorm3D(nnx.Module):
    """`CogVideoXSpatialNorm3D`: GroupNorm(f) * conv_y(zq) + conv_b(zq), zq resized to f.

    When f has an odd number of frames > 1, the first latent frame is resized to the first output
    frame alone and the rest to the rest (the causal "first frame" convention).
    """

    def __init__(self, f_channels: int, zq_channels: int, groups: int, *, dtype, param_dtype, precision, rngs):
        self.norm_layer = GroupNorm(f_channels, groups, eps=1e-6, param_dtype=param_dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.conv_y = CausalConv3d(zq_channels, f_channels, 1, **kw)
        self.conv_b = CausalConv3d(zq_channels, f_channels, 1, **kw)

    def __call__(self, f: jax.Array, zq: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        t, h, w = f.shape[1:4]
        if t > 1 and t % 2 == 1:
            z_first = _resize_nearest(zq[:, :1], {1: 1, 2: h, 3: w})
            z_rest = _resize_nearest(zq[:, 1:], {1: t - 1, 2: h, 3: w})
            zq = jnp.concatenate([z_first, z_rest], axis=1)
        else:
            zq = _resize_nearest(zq, {1: t, 2: h, 3: w})
        zq = _spatial(zq)
        cache = cache or {}
        new: dict[str, Any] = {}
        conv_y, new["conv_y"] = self.conv_y(zq, cache.get("conv_y"))
        conv_b, new["conv_b"] = self.conv_b(zq, cache.get("conv_b"))
        y = self.norm_layer(f) * conv_y + conv_b
        _record(self, y)
        return y, new


class ResnetBlock3D(nnx.Module):
    """`CogVideoXResnetBlock3D` without time embedding (the VAE passes temb=None) or dropout."""

    def __init__(
        self, in_ch: int, out_ch: int, groups: int, eps: float, spatial_norm_dim: int | None,
        *, dtype, param_dtype, precision, rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.in_channels, self.out_channels = in_ch, out_ch
        self.spatial = spatial_norm_dim is not None
        if self.spatial:
            self.norm1 = SpatialNorm3D(in_ch, spatial_norm_dim, groups, **kw)
            self.norm2 = SpatialNorm3D(out_ch, spatial_norm_dim, groups, **kw)
        else:
            self.norm1 = GroupNorm(in_ch, groups, eps, param_dtype=param_dtype)
            self.norm2 = GroupNorm(out_ch, groups, eps, param_dtype=param_dtype)
        self.conv1 = CausalConv3d(in_ch, out_ch, 3, **kw)
        self.conv2 = CausalConv3d(out_ch, out_ch, 3, **kw)
        if in_ch != out_ch:  # diffusers: a plain 1x1x1 Conv3d (conv_shortcut=False)
            self.conv_shortcut = _conv(in_ch, out_ch, (1, 1, 1), **kw)

    def __call__(self, x: jax.Array, zq: jax.Array | None = None, cache: Cache = None) -> tuple[jax.Array, dict]:
        cache = cache or {}
        new: dict[str, Any] = {}
        if self.spatial:
            h, new["norm1"] = self.norm1(x, zq, cache.get("norm1"))
        else:
            h = self.norm1(x)
        h = nnx.silu(h)
        h, new["conv1"] = self.conv1(h, cache.get("conv1"))
        if self.spatial:
            h, new["norm2"] = self.norm2(h, zq, cache.get("norm2"))
        else:
            h = self.norm2(h)
        h = nnx.silu(h)
        h, new["conv2"] = self.conv2(h, cache.get("conv2"))
        if self.in_channels != self.out_channels:
            x = self.conv_shortcut(x)
            _record(self.conv_shortcut, x)
        y = h + x
        _record(self, y)
        return y, new


class Downsample3D(nnx.Module):
    """`CogVideoXDownsample3D`: optional time halving (odd counts keep frame 0), then a 2D conv.

    The conv is a per-frame Conv2d (kernel 3, stride 2) after zero-padding one row at the bottom
    and one column at the right.
    """

    def __init__(self, ch: int, compress_time: bool, *, dtype, param_dtype, precision, rngs):
        self.compress_time = compress_time
        self.conv = _conv(ch, ch, (3, 3), strides=(2, 2), padding="VALID",
                          dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.compress_time:
            t = x.shape[1]
            if t % 2 == 1:
                rest = x[:, 1:]
                if rest.shape[1] > 0:
                    rest = (rest[:, 0::2] + rest[:, 1::2]) / 2
                x = jnp.concatenate([x[:, :1], rest], axis=1)
            else:
                x = (x[:, 0::2] + x[:, 1::2]) / 2
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 1), (0, 1), (0, 0)))
        b, t = x.shape[:2]
        y = self.conv(x.reshape(b * t, *x.shape[2:]))
        y = y.reshape(b, t, *y.shape[1:])
        _record(self, y)
        return y


class Upsample3D(nnx.Module):
    """`CogVideoXUpsample3D`: nearest x2 in space (and in time if `compress_time`), then a 2D conv.

    With `compress_time`: one frame stays one frame; an odd count > 1 keeps frame 0 single and
    doubles the rest; an even count doubles every frame.
    """

    def __init__(self, ch: int, compress_time: bool, *, dtype, param_dtype, precision, rngs):
        self.compress_time = compress_time
        self.conv = _conv(ch, ch, (3, 3), padding=((1, 1), (1, 1)),
                          dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        t = x.shape[1]
        space = lambda a: jnp.repeat(jnp.repeat(a, 2, axis=2), 2, axis=3)  # noqa: E731
        if self.compress_time and t > 1 and t % 2 == 1:
            x = jnp.concatenate([space(x[:, :1]), jnp.repeat(space(x[:, 1:]), 2, axis=1)], axis=1)
        elif self.compress_time and t > 1:
            x = jnp.repeat(space(x), 2, axis=1)
        else:
            x = space(x)
        x = _spatial(x)
        b, t = x.shape[:2]
        y = self.conv(x.reshape(b * t, *x.shape[2:]))
        y = _spatial(y.reshape(b, t, *y.shape[1:]))
        _record(self, y)
        return y


class DownBlock3D(nnx.Module):
    def __init__(self, in_ch, out_ch, num_layers, groups, eps, add_downsample, compress_time, **kw):
        self.resnets = nnx.List(
            [ResnetBlock3D(in_ch if i == 0 else out_ch, out_ch, groups, eps, None, **kw) for i in range(num_layers)]
        )
        self.downsamplers = nnx.List([Downsample3D(out_ch, compress_time, **kw)]) if add_downsample else None

    def __call__(self, x: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        cache = cache or {}
        new: dict[str, Any] = {}
        for i, resnet in enumerate(self.resnets):
            x, new[f"resnet_{i}"] = resnet(x, None, cache.get(f"resnet_{i}"))
        if self.downsamplers is not None:
            for ds in self.downsamplers:
                x = ds(x)
        _record(self, x)
        return x, new


class MidBlock3D(nnx.Module):
    def __init__(self, ch, num_layers, groups, eps, spatial_norm_dim, **kw):
        self.resnets = nnx.List(
            [ResnetBlock3D(ch, ch, groups, eps, spatial_norm_dim, **kw) for _ in range(num_layers)]
        )

    def __call__(self, x, zq=None, cache: Cache = None):
        cache = cache or {}
        new: dict[str, Any] = {}
        for i, resnet in enumerate(self.resnets):
            x, new[f"resnet_{i}"] = resnet(x, zq, cache.get(f"resnet_{i}"))
        _record(self, x)
        return x, new


class UpBlock3D(nnx.Module):
    def __init__(self, in_ch, out_ch, num_layers, groups, eps, spatial_norm_dim, add_upsample, compress_time, **kw):
        self.resnets = nnx.List(
            [
                ResnetBlock3D(in_ch if i == 0 else out_ch, out_ch, groups, eps, spatial_norm_dim, **kw)
                for i in range(num_layers)
            ]
        )
        self.upsamplers = nnx.List([Upsample3D(out_ch, compress_time, **kw)]) if add_upsample else None

    def __call__(self, x, zq, cache: Cache = None):
        cache = cache or {}
        new: dict[str, Any] = {}
        for i, resnet in enumerate(self.resnets):
            x, new[f"resnet_{i}"] = resnet(x, zq, cache.get(f"resnet_{i}"))
        if self.upsamplers is not None:
            for us in self.upsamplers:
                x = us(x)
        _record(self, x)
        return x, new


class Encoder3D(nnx.Module):
    """`CogVideoXEncoder3D`: video (B,T,H,W,3) -> moments (B,T',H',W',2*latent)."""

    def __init__(self, cfg: CogVideoXVAEConfig, **kw):
        ch = cfg.block_out_channels
        levels = int(np.log2(cfg.temporal_compression_ratio))
        self.conv_in = CausalConv3d(cfg.in_channels, ch[0], 3, **kw)
        blocks = []
        out_ch = ch[0]
        for i in range(len(ch)):
            in_ch, out_ch = out_ch, ch[i]
            blocks.append(
                DownBlock3D(in_ch, out_ch, cfg.layers_per_block, cfg.norm_num_groups, cfg.norm_eps,
                            add_downsample=i != len(ch) - 1, compress_time=i < levels, **kw)
            )
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock3D(ch[-1], 2, cfg.norm_num_groups, cfg.norm_eps, None, **kw)
        self.norm_out = GroupNorm(ch[-1], cfg.norm_num_groups, 1e-6, param_dtype=kw["param_dtype"])
        self.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, 3, **kw)

    def __call__(self, x: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        cache = cache or {}
        new: dict[str, Any] = {}
        x, new["conv_in"] = self.conv_in(x, cache.get("conv_in"))
        for i, block in enumerate(self.down_blocks):
            x, new[f"down_block_{i}"] = block(x, cache.get(f"down_block_{i}"))
        x, new["mid_block"] = self.mid_block(x, None, cache.get("mid_block"))
        x = nnx.silu(self.norm_out(x))
        x, new["conv_out"] = self.conv_out(x, cache.get("conv_out"))
        _record(self, x)
        return x, new


class Decoder3D(nnx.Module):
    """`CogVideoXDecoder3D`: latents (B,T,h,w,latent) -> video (B,T',H,W,3); zq = the latents."""

    def __init__(self, cfg: CogVideoXVAEConfig, **kw):
        rev = list(reversed(cfg.block_out_channels))
        levels = int(np.log2(cfg.temporal_compression_ratio))
        zc = cfg.latent_channels
        g = cfg.norm_num_groups
        self.conv_in = CausalConv3d(zc, rev[0], 3, **kw)
        self.mid_block = MidBlock3D(rev[0], 2, g, cfg.norm_eps, zc, **kw)
        blocks = []
        out_ch = rev[0]
        for i in range(len(rev)):
            in_ch, out_ch = out_ch, rev[i]
            blocks.append(
                UpBlock3D(in_ch, out_ch, cfg.layers_per_block + 1, g, cfg.norm_eps, zc,
                          add_upsample=i != len(rev) - 1, compress_time=i < levels, **kw)
            )
        self.up_blocks = nnx.List(blocks)
        self.norm_out = SpatialNorm3D(rev[-1], zc, g, **kw)
        self.conv_out = CausalConv3d(rev[-1], cfg.out_channels, 3, **kw)

    def __call__(self, z: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        cache = cache or {}
        new: dict[str, Any] = {}
        x, new["conv_in"] = self.conv_in(z, cache.get("conv_in"))
        x, new["mid_block"] = self.mid_block(x, z, cache.get("mid_block"))
        for i, block in enumerate(self.up_blocks):
            x, new[f"up_block_{i}"] = block(x, z, cache.get(f"up_block_{i}"))
        x, new["norm_out"] = self.norm_out(x, z, cache.get("norm_out"))
        x = nnx.silu(x)
        x, new["conv_out"] = self.conv_out(x, cache.get("conv_out"))
        _record(self, x)
        return x, new


# ----------------------------------------------------------------------------------- the VAE


@dataclasses.dataclass(frozen=True)
class DiagonalGaussian:
    """diffusers' `DiagonalGaussianDistribution` over channels-first moments (B, 2*latent, T, h, w)."""

    parameters: jax.Array

    @property
    def mean(self) -> jax.Array:
        return jnp.split(self.parameters, 2, axis=1)[0]

    @property
    def logvar(self) -> jax.Array:
        return jnp.clip(jnp.split(self.parameters, 2, axis=1)[1], -30.0, 20.0)

    @property
    def std(self) -> jax.Array:
        return jnp.exp(0.5 * self.logvar)

    def mode(self) -> jax.Array:
        return self.mean

    def sample(self, key: jax.Array) -> jax.Array:
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("spatial",))
def _jit_apply(graphdef: Any, method: str, state: Any, *args: Any, spatial: Any = None) -> Any:
    with _splitting(spatial):
        return getattr(nnx.merge(graphdef, state), method)(*args)


class AutoencoderKLCogVideoX(nnx.Module):
    """Flax NNX twin of `diffusers.AutoencoderKLCogVideoX` (inference only).

    Public methods take and return channels-first arrays, like diffusers:
    `encode(video (B,3,T,H,W)) -> DiagonalGaussian`, `decode(latents (B,C,t,h,w)) -> video`.
    Neither applies `scaling_factor` (diffusers does not either: the pipeline divides by it
    before `decode`). `encode_chunk` / `decode_chunk` are one frame batch, channels-last, with
    the conv cache in and out: the unit to jit.
    """

    def __init__(
        self,
        config: CogVideoXVAEConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.encoder = Encoder3D(config, **kw)
        self.decoder = Decoder3D(config, **kw)
        # diffusers sizes quant_conv by out_channels, not latent_channels; mirrored as is.
        oc = config.out_channels
        self.quant_conv = _conv(2 * oc, 2 * oc, (1, 1, 1), **kw) if config.use_quant_conv else None
        self.post_quant_conv = _conv(oc, oc, (1, 1, 1), **kw) if config.use_post_quant_conv else None
        self.num_latent_frames_batch_size = 2
        self.num_sample_frames_batch_size = 8
        self.use_tiling = False
        self.tile_sample_min_height = config.sample_height // 2
        self.tile_sample_min_width = config.sample_width // 2
        self.tile_overlap_factor_height = 1 / 6
        self.tile_overlap_factor_width = 1 / 5

    # -- tiling, as in diffusers
    @property
    def tile_latent_min_height(self) -> int:
        return int(self.tile_sample_min_height / self.config.spatial_compression_ratio)

    @property
    def tile_latent_min_width(self) -> int:
        return int(self.tile_sample_min_width / self.config.spatial_compression_ratio)

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_overlap_factor_height: float | None = None,
        tile_overlap_factor_width: float | None = None,
    ) -> None:
        """Same arguments and meaning as diffusers' `enable_tiling`."""
        self.use_tiling = True
        self.tile_sample_min_height = tile_sample_min_height or self.tile_sample_min_height
        self.tile_sample_min_width = tile_sample_min_width or self.tile_sample_min_width
        self.tile_overlap_factor_height = tile_overlap_factor_height or self.tile_overlap_factor_height
        self.tile_overlap_factor_width = tile_overlap_factor_width or self.tile_overlap_factor_width

    def disable_tiling(self) -> None:
        self.use_tiling = False

    # -- validation (before any compute)
    def check_video(self, x: Any) -> None:
        """Raise `VAEInputError` unless `x` is (B, in_channels, 1 + k*ratio, H, W)."""
        cfg = self.config
        r = cfg.temporal_compression_ratio
        if len(x.shape) != 5:
            raise VAEInputError(f"video must be (B, C, T, H, W), got shape {tuple(x.shape)}")
        if x.shape[1] != cfg.in_channels:
            raise VAEInputError(
                f"video has {x.shape[1]} channels at axis 1; this VAE takes {cfg.in_channels} "
                f"(channels-first, like diffusers: (B, C, T, H, W))"
            )
        t = x.shape[2]
        if t < 1 or (t - 1) % r:
            allowed = ", ".join(str(1 + r * k) for k in range(5))
            raise VAEInputError(
                f"video has {t} frames; temporal compression x{r} needs 1 + {r}*k frames ({allowed}, ...)"
            )
        if min(x.shape[3:]) < 1:
            raise VAEInputError(f"video has an empty spatial size {tuple(x.shape[3:])}")

    def check_latents(self, z: Any) -> None:
        """Raise `VAEInputError` unless `z` is (B, latent_channels, t >= 1, h, w)."""
        cfg = self.config
        if len(z.shape) != 5:
            raise VAEInputError(f"latents must be (B, C, t, h, w), got shape {tuple(z.shape)}")
        if z.shape[1] != cfg.latent_channels:
            hint = " (did you pass channels-last latents?)" if z.shape[-1] == cfg.latent_channels else ""
            raise VAEInputError(
                f"latents have {z.shape[1]} channels at axis 1; this VAE has latent_channels="
                f"{cfg.latent_channels}{hint}"
            )
        if min(z.shape[2:]) < 1:
            raise VAEInputError(f"latents have an empty frame or spatial axis: shape {tuple(z.shape)}")

    # -- one frame batch (channels-last): what gets jitted
    def encode_chunk(self, x: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        h, cache = self.encoder(x, cache)
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        return h, cache

    def decode_chunk(self, z: jax.Array, cache: Cache = None) -> tuple[jax.Array, dict]:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z, cache)

    def _runner(self, method: str, jit: bool, spatial: Any = None):
        if not jit:
            def run(*args):
                with _splitting(spatial):
                    return getattr(self, method)(*args)

            return run
        graphdef, state = nnx.split(self)
        return functools.partial(_jit_apply, graphdef, method, state, spatial=spatial)

    def _frames(self, x: jax.Array, run, batch: int) -> jax.Array:
        cache = None
        outs = []
        for start, end in frame_batches(x.shape[1], batch):
            y, cache = run(x[:, start:end], cache)
            outs.append(y)
        return jnp.concatenate(outs, axis=1)

    # -- public, channels-first
    def encode(self, x: jax.Array, *, jit: bool = True) -> DiagonalGaussian:
        """Video (B, C, T, H, W) -> posterior over latents (B, latent, 1 + (T-1)/ratio, H/8, W/8)."""
        self.check_video(x)
        return DiagonalGaussian(to_channels_first(self.encode_channels_last(to_channels_last(jnp.asarray(x)), jit=jit)))

    def decode(self, z: jax.Array, *, jit: bool = True, tiles: TileRunner | None = None,
               spatial: Any = None) -> jax.Array:
        """Latents (B, C, t, h, w) -> video (B, 3, T, 8h, 8w); no scaling, no clipping.

        Two ways to share the work between chips, for a pipeline (`tpupedia.pipelines.decoding`):
        with tiling, `tiles(pieces, decode_one)` decodes the tiles and returns their videos in
        order (default: one after another, as diffusers does); without, `spatial` (a
        `NamedSharding` of the (B, T, H, W, C) activations) splits every activation of the whole
        latent's decode over the chips along height or width. Time is never split: each frame
        batch needs the previous one's causal cache."""
        self.check_latents(z)
        z = z if isinstance(z, jax.Array) else jnp.asarray(z)
        return to_channels_first(self.decode_channels_last(to_channels_last(z), jit=jit, tiles=tiles,
                                                           spatial=spatial))

    def encode_channels_last(self, x: jax.Array, *, jit: bool = True) -> jax.Array:
        x = x.astype(self.dtype)
        run = self._runner("encode_chunk", jit)
        h, w = x.shape[2:4]
        if self.use_tiling and (w > self.tile_sample_min_width or h > self.tile_sample_min_height):
            return self._tiled(x, run, encode=True)
        return self._frames(x, run, self.num_sample_frames_batch_size)

    def decode_channels_last(self, z: jax.Array, *, jit: bool = True, tiles: TileRunner | None = None,
                             spatial: Any = None) -> jax.Array:
        z = z.astype(self.dtype)
        h, w = z.shape[2:4]
        if self.use_tiling and (w > self.tile_latent_min_width or h > self.tile_latent_min_height):
            return self._tiled(z, self._runner("decode_chunk", jit), encode=False, tiles=tiles)
        return self._frames(z, self._runner("decode_chunk", jit, spatial), self.num_latent_frames_batch_size)

    def _tiled(self, x: jax.Array, run, *, encode: bool, tiles: TileRunner = None) -> jax.Array:
        """diffusers' `tiled_encode` / `tiled_decode`, channels-last: cut the tiles, run each
        through its frame batches (`tiles`, default one after another), blend, crop, join."""
        fh, fw = self.tile_overlap_factor_height, self.tile_overlap_factor_width
        sh, sw = self.tile_sample_min_height, self.tile_sample_min_width
        lh, lw = self.tile_latent_min_height, self.tile_latent_min_width
        in_h, in_w, out_h, out_w = (sh, sw, lh, lw) if encode else (lh, lw, sh, sw)
        batch = self.num_sample_frames_batch_size if encode else self.num_latent_frames_batch_size
        step_h, step_w = int(in_h * (1 - fh)), int(in_w * (1 - fw))
        blend_h_ext, blend_w_ext = int(out_h * fh), int(out_w * fw)
        keep_h, keep_w = out_h - blend_h_ext, out_w - blend_w_ext
        height, width = x.shape[2:4]
        starts = [(i, j) for i in range(0, height, step_h) for j in range(0, width, step_w)]
        pieces = [x[:, :, i : i + in_h, j : j + in_w] for i, j in starts]
        done = iter((tiles or one_by_one)(pieces, lambda piece: self._frames(piece, run, batch)))
        rows = [[next(done) for _ in range(0, width, step_w)] for _ in range(0, height, step_h)]
        # Blend in place, like diffusers: a tile is blended with its already-blended neighbours.
        for i, row in enumerate(rows):
            for j in range(len(row)):
                tile = row[j]
                if i > 0:
                    tile = _blend(rows[i - 1][j], tile, blend_h_ext, axis=2)
                if j > 0:
                    tile = _blend(row[j - 1], tile, blend_w_ext, axis=3)
                row[j] = tile
        return jnp.concatenate(
            [jnp.concatenate([t[:, :, :keep_h, :keep_w] for t in row], axis=3) for row in rows], axis=2
        )


def _blend(a: jax.Array, b: jax.Array, extent: int, axis: int) -> jax.Array:
    """diffusers' blend_v (axis=H) / blend_h (axis=W): linear ramp from a's end into b's start."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    w = (np.arange(extent) / extent).astype(np.float32)
    shape = [1] * b.ndim
    shape[axis] = extent
    w = jnp.asarray(w.reshape(shape), dtype=b.dtype)
    a_end = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis)
    b_start = jax.lax.slice_in_dim(b, 0, extent, axis=axis)
    mixed = a_end * (1 - w) + b_start * w
    return jax.lax.dynamic_update_slice_in_dim(b, mixed.astype(b.dtype), 0, axis=axis)
