"""Weights in, differences out: converting diffusers CogVideoX VAE weights to the Flax NNX port,
and comparing the two layer by layer.

Introduced in notebook `cogvideox_vae_flax` (CogVideoX VAE in Flax NNX).

The NNX module tree uses diffusers' attribute names, so a state-dict key maps to an NNX path by
splitting on dots; only the *leaf* changes, by the rules in `WEIGHT_RULES` (a kernel transpose
for convolutions, `weight` -> `scale` for norms). Checkpoints are read from safetensors only;
nothing here unpickles.

One loading path for both presets (`tpupedia.models.checkpoints`): `model_source(preset)` names the
real `zai-org/CogVideoX1.5-5B` on the full preset and, on the tiny one, a random tiny VAE that
`tiny_checkpoint` writes once with `save_pretrained` into the `vae/` folder of a cached directory;
diffusers' `from_pretrained(source, subfolder="vae")` and this module's `from_pretrained` then read
either the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpupedia.errors import TpupediaError
from tpupedia.models import cogvideox_vae as vae_mod
from tpupedia.models.cogvideox_vae import AutoencoderKLCogVideoX, CogVideoXVAEConfig
from tpupedia.models.spec import FamilySpec, QuotedFigure

__all__ = [
    "WeightRule",
    "WEIGHT_RULES",
    "WeightConversionError",
    "nnx_path",
    "convert_state_dict",
    "abstract_vae",
    "dryrun_decoder",
    "SPEC",
    "from_state_dict",
    "from_diffusers",
    "from_pretrained",
    "NORM_NOISE",
    "tiny_checkpoint",
    "model_source",
    "LayerDiff",
    "compare_layers",
    "first_divergence",
]


class WeightConversionError(TpupediaError, ValueError):
    """A state dict that does not match the NNX model: missing, unexpected or mis-shaped tensors."""


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """How one kind of PyTorch tensor becomes an NNX parameter."""

    torch_leaf: str
    ndim: int
    nnx_leaf: str
    transpose: tuple[int, ...] | None
    what: str


WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule("weight", 5, "kernel", (2, 3, 4, 1, 0), "Conv3d weight (O, I, kT, kH, kW) -> kernel (kT, kH, kW, I, O)"),
    WeightRule("weight", 4, "kernel", (2, 3, 1, 0), "Conv2d weight (O, I, kH, kW) -> kernel (kH, kW, I, O)"),
    WeightRule("weight", 2, "kernel", (1, 0), "Linear weight (O, I) -> kernel (I, O)"),
    WeightRule("weight", 1, "scale", None, "GroupNorm weight (C,) -> scale (C,)"),
    WeightRule("bias", 1, "bias", None, "any bias (C,) -> bias (C,), unchanged"),
)


def _rule(leaf: str, ndim: int) -> WeightRule:
    for r in WEIGHT_RULES:
        if r.torch_leaf == leaf and r.ndim == ndim:
            return r
    raise WeightConversionError(f"no conversion rule for a {ndim}-d tensor named {leaf!r}")


def nnx_path(key: str, ndim: int) -> tuple[tuple[str | int, ...], WeightRule]:
    """`'decoder.up_blocks.0.resnets.1.conv1.conv.weight'` (5-d) ->
    `(('decoder','up_blocks',0,'resnets',1,'conv1','conv','kernel'), <Conv3d rule>)`."""
    key = key.removeprefix("_orig_mod.")  # torch.compile'd modules
    *parents, leaf = key.split(".")
    rule = _rule(leaf, ndim)
    path = tuple(int(p) if p.isdigit() else p for p in parents) + (rule.nnx_leaf,)
    return path, rule


def convert_state_dict(state_dict: Mapping[str, Any], dtype: Any = None) -> dict[tuple, jax.Array]:
    """diffusers state dict (torch tensors or numpy/jax arrays) -> {nnx path: array}, cast to `dtype`
    (bf16 values stay exact: bf16 -> float32 -> bf16 is lossless)."""
    out = {}
    for key, t in state_dict.items():
        a = _to_host(t)
        path, rule = nnx_path(key, a.ndim)
        if rule.transpose is not None:  # on the host: a device transpose compiles a program per kernel shape
            a = np.transpose(a, rule.transpose)
        a = jnp.asarray(a)
        out[path] = a.astype(dtype) if dtype is not None else a
    return out


def _to_host(t: Any) -> np.ndarray:
    """A torch tensor or an array as a host NumPy array; torch's bfloat16 through float32 to
    ml_dtypes' bfloat16, which is exact both ways (NumPy itself has no bfloat16)."""
    if hasattr(t, "detach"):  # torch.Tensor
        import torch

        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.float().numpy().astype(jnp.bfloat16)
        return t.numpy()
    return np.asarray(t)


class _OneKey:
    """What `abstract_vae` hands the layers for `rngs`: each stream (`rngs.params()`) returns one
    fixed key. Under `nnx.eval_shape` a real `nnx.Rngs` counts every draw in a traced variable,
    and each count's update asks the tracer for its sharding, an error message JAX builds by
    walking every operation traced so far: quadratic in the layers, 1.4 s for the tiny VAE and
    3.5 s for the released one, against 0.5 s and 0.8 s here. Only shapes come out, so the key
    does not matter; the module tree is the same (tests/test_cogvideox_vae.py)."""

    def __init__(self) -> None:
        self._key = jax.random.key(0)

    def __call__(self) -> jax.Array:
        return self._key

    def __getattr__(self, stream: str):
        if stream.startswith("_"):
            raise AttributeError(stream)
        return self


def abstract_vae(config: CogVideoXVAEConfig, **kwargs: Any) -> AutoencoderKLCogVideoX:
    """The model with `jax.ShapeDtypeStruct` leaves: shapes only, no weights allocated."""
    return nnx.eval_shape(lambda: AutoencoderKLCogVideoX(config, rngs=_OneKey(), **kwargs))


def dryrun_decoder(width: int, height: int, placement: Any) -> tuple[Any, tuple, int, str]:
    """One frame batch of the released VAE's decoder (this Flax NNX port, bf16, untiled) for the
    dry-run (`tpupedia dryrun cogvideox-vae`): `(decode, (state, latents), tokens, note)`, the
    arguments abstract and placed by `placement` (one chip's sharding). Sizes that are not
    multiples of the VAE's compression raise `ModelInputError`."""
    from tpupedia import aot
    from tpupedia.models import ModelInputError

    config = CogVideoXVAEConfig()
    ratio = config.spatial_compression_ratio
    if width % ratio or height % ratio:
        raise ModelInputError(f"resolution {width}x{height}: the VAE needs multiples of {ratio}")
    graph, state = nnx.split(abstract_vae(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    state = jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, placement), state)
    latents = aot.abstract((1, 2, height // ratio, width // ratio, config.latent_channels), jnp.bfloat16, placement)

    def decode(st, z):
        return nnx.merge(graph, st).decode_chunk(z, None)[0]

    note = ("one frame batch (2 latent frames -> 8 video frames) of the Flax NNX decoder (notebook `cogvideox_vae_flax`), "
            "bf16, untiled, on one chip; FLOPs are XLA's count of the program lowered for the host")
    return decode, (state, latents), 2 * (height // ratio) * (width // ratio), note


SPEC = FamilySpec(name="cogvideox-vae", module=__name__, kind="vae", defaults_from="cogvideox", layer_prefix="",
                  title="CogVideoX's VAE decoder in Flax NNX (notebook `cogvideox_vae_flax`): one frame batch on one chip",
                  figures=(QuotedFigure("dryrun.cogvideox_vae_gib", "dryrun_peak", decimals=1,
                                        match={"model": "cogvideox-vae", "width": 1360, "height": 768},
                                        source="docs/results/dryruns.json: tpupedia dryrun cogvideox-vae (AOT here, "
                                               "one chip, one frame batch)"),))
"""This dry-run target in the registry (`tpupedia.families`): the frame and size rules and the
default request are CogVideoX's."""


def from_state_dict(
    config: CogVideoXVAEConfig | Mapping[str, Any],
    state_dict: Mapping[str, Any],
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    precision: Any = None,
) -> AutoencoderKLCogVideoX:
    """Build the NNX VAE directly from converted weights (no random init), strictly: every
    parameter must be provided with the right shape, and every tensor must be used."""
    if not isinstance(config, CogVideoXVAEConfig):
        config = CogVideoXVAEConfig.from_dict(config)
    param_dtype = param_dtype or dtype
    graphdef, abstract = nnx.split(abstract_vae(config, dtype=dtype, param_dtype=param_dtype, precision=precision))
    flat = dict(nnx.to_flat_state(abstract))
    weights = convert_state_dict(state_dict, param_dtype)
    missing = sorted(".".join(map(str, p)) for p in flat if p not in weights)
    unexpected = sorted(".".join(map(str, p)) for p in weights if p not in flat)
    if missing or unexpected:
        raise WeightConversionError(
            f"state dict does not match the config: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for path, var in flat.items():
        if weights[path].shape != var.get_value().shape:
            raise WeightConversionError(
                f"{'.'.join(map(str, path))}: checkpoint shape {weights[path].shape}, model expects {var.get_value().shape}"
            )
        var.set_value(weights[path])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def from_diffusers(torch_vae: Any, *, dtype: Any = jnp.float32, precision: Any = None) -> AutoencoderKLCogVideoX:
    """Convert a live `diffusers.AutoencoderKLCogVideoX`, copying its tiling/frame-batch settings."""
    model = from_state_dict(dict(torch_vae.config), torch_vae.state_dict(), dtype=dtype, precision=precision)
    for name in (
        "use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_overlap_factor_height",
        "tile_overlap_factor_width", "num_latent_frames_batch_size", "num_sample_frames_batch_size",
    ):
        setattr(model, name, getattr(torch_vae, name))
    return model


def from_pretrained(
    path_or_id: str | os.PathLike, *, subfolder: str | None = None, dtype: Any = jnp.float32, precision: Any = None
) -> AutoencoderKLCogVideoX:
    """Load `config.json` + `*.safetensors` from a directory (as written by diffusers'
    `save_pretrained(..., safe_serialization=True)`), or from a Hub id via
    `huggingface_hub.snapshot_download` (honours HF_HUB_OFFLINE), optionally from its `subfolder`
    (`"vae"` in a pipeline repository). Parameters and compute are cast to `dtype` whatever the
    checkpoint stores (bf16 -> float32 is exact). Never unpickles: `.bin` files are ignored."""
    path = Path(path_or_id)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder}/" if subfolder else ""
        path = Path(snapshot_download(str(path_or_id), allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"]))
    if subfolder:
        if not (path / subfolder).is_dir():
            found = sorted(p.name for p in path.iterdir())
            raise FileNotFoundError(f"no subfolder {subfolder!r} in {path.name!r}; found {found}")
        path = path / subfolder
    config_file = path / "config.json"
    files = _weight_files(path)
    if not config_file.is_file() or not files:
        found = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(f"need config.json and *.safetensors in {path.name!r}; found {found}")
    from safetensors import safe_open

    state: dict[str, Any] = {}
    for f in files:
        with safe_open(f, framework="flax") as fh:  # "numpy" cannot hold bfloat16; "flax" can
            for k in fh.keys():
                state[k] = fh.get_tensor(k)
    return from_state_dict(json.loads(config_file.read_text()), state, dtype=dtype, precision=precision)


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of one checkpoint: those its shard index names, else diffusers' default
    file, else every `*.safetensors` (so a variant such as `*.fp16.safetensors` never clashes)."""
    index = path / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    default = path / "diffusion_pytorch_model.safetensors"
    return [default] if default.is_file() else sorted(path.glob("*.safetensors"))


NORM_NOISE = 0.1
"""Standard deviation of the noise `tiny_checkpoint` adds to every 1-d parameter: GroupNorm scales
start at exactly 1 and shifts at 0, where a swapped scale and bias would go unnoticed."""


class _VAEOnlyRepo:
    """What `checkpoints.cached_pipeline` saves for the tiny preset: the VAE in `vae/`, where a
    pipeline repository keeps it, and a `model_index.json` naming it (the file the cache checks)."""

    def __init__(self, vae: Any):
        self.vae = vae

    def save_pretrained(self, directory: str | os.PathLike, safe_serialization: bool = True) -> None:
        self.vae.save_pretrained(Path(directory) / "vae", safe_serialization=safe_serialization)
        index = {"vae": ["diffusers", type(self.vae).__name__]}
        (Path(directory) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def tiny_checkpoint(directory: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """A random tiny `diffusers.AutoencoderKLCogVideoX` (`cogvideox.tiny_vae_config()`, float32,
    1-d parameters perturbed by `NORM_NOISE`) saved with `save_pretrained(safe_serialization=True)`
    into `<directory>/vae`; cached and written atomically by `checkpoints.cached_pipeline`."""
    from tpupedia.models import checkpoints, cogvideox

    spec = ["vae-only", cogvideox.tiny_vae_config(), NORM_NOISE, seed]

    def build() -> _VAEOnlyRepo:
        import torch
        from diffusers import AutoencoderKLCogVideoX as TorchVAE

        torch.manual_seed(seed)
        vae = TorchVAE(**cogvideox.tiny_vae_config()).eval()
        with torch.no_grad():
            for p in vae.parameters():
                if p.ndim == 1:
                    p.add_(NORM_NOISE * torch.randn_like(p))
        return _VAEOnlyRepo(vae)

    return checkpoints.cached_pipeline("cogvideox-vae-tiny", spec, build, directory)


def model_source(preset: Any, model: str | os.PathLike | None = None) -> tuple[str, str]:
    """`(where to load from, label to print)`: `model` if given, else `$TPUPEDIA_COGVIDEOX` (a
    CogVideoX pipeline checkpoint), else the preset's: `zai-org/CogVideoX1.5-5B` on full, the
    `tiny_checkpoint` on tiny (labelled `preset:tiny`). Load its `vae` subfolder."""
    from tpupedia.models import checkpoints, cogvideox

    return checkpoints.choose_source(preset, model, cogvideox.ENV_MODEL, cogvideox.FULL_ID, tiny_checkpoint)


# ----------------------------------------------------------------------------------- layer diff


@dataclasses.dataclass(frozen=True)
class LayerDiff:
    """One layer call: its dotted name (diffusers naming), which call (frame batch) it was,
    the output shape (channels-first) and the max abs difference torch vs NNX."""

    name: str
    call: int
    shape: tuple[int, ...]
    max_abs_err: float


_TORCH_TYPES = (
    "CogVideoXCausalConv3d", "GroupNorm", "CogVideoXSpatialNorm3D", "CogVideoXResnetBlock3D",
    "CogVideoXDownsample3D", "CogVideoXUpsample3D", "CogVideoXDownBlock3D", "CogVideoXMidBlock3D",
    "CogVideoXUpBlock3D", "CogVideoXEncoder3D", "CogVideoXDecoder3D",
)


@contextlib.contextmanager
def _capture_flax(model: nnx.Module) -> Iterator[list]:
    names = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and path:
            names[id(node)] = ".".join(map(str, path))
    vae_mod._records.clear()
    vae_mod._capture = names
    try:
        yield vae_mod._records
    finally:
        vae_mod._capture = None


def compare_layers(torch_vae: Any, flax_vae: AutoencoderKLCogVideoX, x: Any, *, mode: str = "decode") -> list[LayerDiff]:
    """Run `encode` or `decode` on the same input in both models, eagerly, recording every
    layer's output (torch forward hooks; a capture list on the NNX side), and return the
    differences in the order the layers finished."""
    import torch

    if mode not in ("encode", "decode"):
        raise ValueError(f"mode must be 'encode' or 'decode', got {mode!r}")
    x_np = np.asarray(x, dtype=np.float32)
    torch_out: list[tuple[str, np.ndarray]] = []
    hooks = []
    for name, mod in torch_vae.named_modules():
        is_shortcut = name.endswith(".conv_shortcut") and type(mod).__name__ == "CogVideoXSafeConv3d"
        if type(mod).__name__ in _TORCH_TYPES or is_shortcut:
            def hook(_m, _inp, out, name=name):
                out = out[0] if isinstance(out, tuple) else out
                torch_out.append((name, out.detach().float().cpu().numpy()))
            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            t = torch.from_numpy(x_np)
            torch_vae.encode(t) if mode == "encode" else torch_vae.decode(t)
    finally:
        for h in hooks:
            h.remove()
    with _capture_flax(flax_vae) as records:
        (flax_vae.encode if mode == "encode" else flax_vae.decode)(jnp.asarray(x_np), jit=False)
        flax_out = [(n, np.asarray(a, dtype=np.float32)) for n, a in records]
    flax_by_key: dict[tuple[str, int], np.ndarray] = {}
    counts: dict[str, int] = {}
    for n, a in flax_out:
        i = counts.get(n, 0)
        counts[n] = i + 1
        flax_by_key[(n, i)] = np.moveaxis(a, -1, 1)  # channels-last -> channels-first
    result = []
    counts = {}
    for n, a in torch_out:
        i = counts.get(n, 0)
        counts[n] = i + 1
        b = flax_by_key.get((n, i))
        err = float(np.max(np.abs(a - b))) if b is not None and b.shape == a.shape else float("inf")
        result.append(LayerDiff(n, i, tuple(a.shape), err))
    return result


def first_divergence(diffs: list[LayerDiff], tol: float = 1e-4) -> LayerDiff | None:
    """The first layer call (in execution order) whose max abs error exceeds `tol`, or None."""
    return next((d for d in diffs if not d.max_abs_err <= tol), None)
