"""Plan a TPU run without a TPU: compile one full-size step for a TPU slice on a CPU host.

The model is built on PyTorch's `meta` device (shapes only: no weights, no download), every
parameter becomes an abstract, sharded `jax.ShapeDtypeStruct`, and one step (a denoising step
with its classifier-free-guidance batch of 2, or an LLM forward) is traced through torchax and
compiled by the real TPU compiler for the slice (`tpupedia.devices.topology_mesh`). The report
gives per-chip memory against the chip's HBM (or the compiler's out-of-memory figures), the
collectives in the compiled program, the step's analytic FLOPs, the roofline lower bound on its
time, and, given a measured step time, the implied MFU.

`layers=N` compiles a shallower copy. Weights are arguments, so their per-chip bytes are known
per layer: the report adds the missing layers' shards from their shapes. Temporaries are
taken as compiled: layers run one after another and reuse most of their working set, so one
layer gives the order of magnitude, but the full program can need more (for CogVideoX at 720p
and 81 frames with reference attention, 35.96 GiB at one layer and 39.84 GiB at 42, both
measured here). Confirm a shallow "fits" near the limit with a full-depth compile. The report
says when it scaled.

Introduced in notebook 09 (plan a TPU run without a TPU).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tpupedia import aot, devices, hardware
from tpupedia import sharding as sharding_rules

__all__ = [
    "DryRunError",
    "MODELS",
    "RESOLUTIONS",
    "parse_resolution",
    "cogvideox_config",
    "hunyuan_config",
    "llama_config",
    "cogvideox_step_flops",
    "hunyuan_step_flops",
    "llama_forward_flops",
    "DryRunReport",
    "run",
    "DEFAULT_RECORDS",
    "record",
]

DEFAULT_RECORDS = "docs/results/dryruns.json"

MODELS = ("cogvideox", "cogvideox-vae", "hunyuan", "llama")
RESOLUTIONS = {"720p": (1280, 720), "480p": (848, 480)}
CFG_BATCH = 2  # classifier-free guidance: the negative and the positive prompt in one batch


class DryRunError(ValueError):
    """A dry-run request that cannot describe a valid step (bad model, size, frames, mesh)."""


def parse_resolution(value: str, multiple: int) -> tuple[int, int]:
    """`"720p"`, `"480p"` or `"WxH"` → `(width, height)`, each a multiple of `multiple`."""
    key = value.strip().lower()
    if key in RESOLUTIONS:
        width, height = RESOLUTIONS[key]
    else:
        m = re.fullmatch(r"(\d+)x(\d+)", key)
        if not m:
            raise DryRunError(f"resolution {value!r} is not one of {', '.join(RESOLUTIONS)} or WIDTHxHEIGHT")
        width, height = int(m.group(1)), int(m.group(2))
    if width % multiple or height % multiple or width <= 0 or height <= 0:
        raise DryRunError(f"resolution {width}x{height}: width and height must be positive multiples of {multiple}")
    return width, height


# --- model configurations (full size) ---------------------------------------------------------

def cogvideox_config(layers: int | None = None) -> dict[str, Any]:
    """CogVideoX1.5-5B transformer (diffusers `CogVideoXTransformer3DModel`), per its public
    config: 42 layers, 48 heads of 64, patch 2x2 and 2 frames, T5 text width 4096."""
    return dict(
        activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64,
        in_channels=16, out_channels=16, max_text_seq_length=226, norm_elementwise_affine=True,
        norm_eps=1e-5, num_attention_heads=48, num_layers=42 if layers is None else layers,
        patch_size=2, patch_size_t=2, patch_bias=False, sample_frames=81, sample_height=300,
        sample_width=300, spatial_interpolation_scale=1.875, temporal_compression_ratio=4,
        temporal_interpolation_scale=1.0, text_embed_dim=4096, time_embed_dim=512,
        timestep_activation_fn="silu", use_learned_positional_embeddings=False,
        use_rotary_positional_embeddings=True, flip_sin_to_cos=True, freq_shift=0,
    )


def hunyuan_config(layers: int | None = None) -> dict[str, Any]:
    """HunyuanVideo-1.5 720p text-to-video transformer: diffusers' defaults (54 layers, 16 heads
    of 128, MLP ratio 4, Qwen2.5-VL text width 3584, ByT5 width 1472), task `t2v`."""
    return dict(num_layers=54 if layers is None else layers, task_type="t2v")


def llama_config(layers: int | None = None) -> dict[str, Any]:
    """Llama-2-7B: 32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000."""
    return dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32 if layers is None else layers, num_attention_heads=32,
                num_key_value_heads=32, max_position_embeddings=4096, use_cache=False)


# --- analytic FLOPs ----------------------------------------------------------------------------

def cogvideox_step_flops(width: int, height: int, frames: int, layers: int = 42, batch: int = CFG_BATCH,
                         heads: int = 48, head_dim: int = 64, text_tokens: int = 226) -> dict[str, float]:
    """Matmul FLOPs of one CogVideoX1.5 transformer step (2 FLOPs per multiply-add).

    Per layer and token: q, k, v, out projections (4 d^2) and a 4x MLP (8 d^2), times 2 FLOPs;
    attention: QK^T and PV, 2 * 2 * S^2 * d per layer. Embeddings and norms are ignored (<1%).
    """
    d = heads * head_dim
    latent_frames = (frames - 1) // 4 + 1
    video_tokens = math.ceil(latent_frames / 2) * (height // 16) * (width // 16)
    s = video_tokens + text_tokens
    linear = batch * layers * 2 * s * 12 * d * d
    attention = batch * layers * 4 * s * s * d
    return {"tokens": s, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def hunyuan_step_flops(width: int, height: int, frames: int, layers: int = 54, batch: int = CFG_BATCH,
                       heads: int = 16, head_dim: int = 128, text_tokens: int = 1256, mlp_ratio: float = 4.0) -> dict[str, float]:
    """Matmul FLOPs of one HunyuanVideo-1.5 step: dual-stream blocks, so every token (video and
    text) goes through q, k, v, out (4 d^2) and the MLP (2 * mlp_ratio * d^2) once per layer."""
    d = heads * head_dim
    latent_frames = (frames - 1) // 4 + 1
    s = latent_frames * (height // 16) * (width // 16) + text_tokens
    linear = batch * layers * 2 * s * (4 + 2 * mlp_ratio) * d * d
    attention = batch * layers * 4 * s * s * d
    return {"tokens": s, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def llama_forward_flops(seq: int, batch: int = 1, layers: int = 32, hidden: int = 4096,
                        mlp: int = 11008, vocab: int = 32000) -> dict[str, float]:
    """Matmul FLOPs of one Llama forward over `batch x seq` tokens (causal attention counted full)."""
    tokens = batch * seq
    linear = 2 * tokens * (layers * (4 * hidden * hidden + 3 * hidden * mlp) + hidden * vocab)
    attention = batch * layers * 4 * seq * seq * hidden
    return {"tokens": tokens, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


# --- the report --------------------------------------------------------------------------------

@dataclass
class DryRunReport:
    """What one AOT dry-run found. Bytes are per chip."""

    model: str
    topology: str
    chip: str
    num_chips: int
    mesh: dict[str, int]
    sharding: str
    attention: str
    width: int | None
    height: int | None
    frames: int | None
    tokens: int
    layers_full: int
    layers_compiled: int
    hbm_bytes: float
    """HBM the TPU compiler makes available to a program per chip (measured, `aot.hbm_budget`)."""
    fits: bool
    arguments_bytes: float | None
    temporaries_bytes: float | None
    outputs_bytes: float | None
    oom_required_bytes: float | None
    oom_available_bytes: float | None
    collectives: dict[str, int]
    flops: dict[str, float]
    roofline_seconds: float
    measured_step_seconds: float | None = None
    mfu: float | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        g = 2**30
        size = f"{self.width}x{self.height}, {self.frames} frames" if self.width else f"{self.tokens} tokens"
        lines = [f"{self.model} {size} on {self.topology} ({self.num_chips} x {self.chip}), "
                 f"mesh {self.mesh}, sharding {self.sharding}, attention {self.attention}"]
        if self.fits:
            lines.append(f"  fits: arguments {self.arguments_bytes / g:.2f} GiB + temporaries "
                         f"{self.temporaries_bytes / g:.2f} GiB + outputs {self.outputs_bytes / g:.2f} GiB "
                         f"per chip, of {self.hbm_bytes / g:.2f} GiB HBM")
        else:
            lines.append(f"  does not fit: the compiler needs {self.oom_required_bytes / g:.2f} GiB of "
                         f"temporaries and has {self.oom_available_bytes / g:.2f} GiB per chip")
        lines.append(f"  collectives: {self.collectives or 'none'}")
        lines.append(f"  step FLOPs {self.flops['total']:.3e} (attention {self.flops['attention'] / self.flops['total']:.0%}); "
                     f"roofline lower bound {self.roofline_seconds:.3f} s")
        if self.mfu is not None:
            lines.append(f"  measured {self.measured_step_seconds:.2f} s/step -> MFU {self.mfu:.1%}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _validate(model: str, frames: int | None, sharding: str, attention: str, layers: int | None) -> None:
    if model not in MODELS:
        raise DryRunError(f"model {model!r} is not one of {', '.join(MODELS)}")
    strategies = sorted(st for fam, st in sharding_rules.RULES if fam == model)
    if model != "cogvideox-vae" and sharding not in strategies:  # the VAE runs whole on one chip
        raise DryRunError(f"sharding {sharding!r} is not one of {', '.join(strategies)} for {model}")
    if attention not in ("reference", "splash"):
        raise DryRunError(f"attention {attention!r} is not one of reference, splash")
    if model != "llama" and (frames is None or frames < 1 or (frames - 1) % 4):
        raise DryRunError(f"frames={frames}: video models need 4n+1 frames (the VAE compresses time by 4), e.g. 49, 81, 121")
    if layers is not None and layers < 1:
        raise DryRunError(f"layers={layers} must be a positive integer")


def run(model: str = "cogvideox", topology: str = "v6e:2x4", resolution: str = "720p",
        frames: int | None = 81, sharding: str = "tp", attention: str = "reference",
        layers: int | None = None, mesh_shape: tuple[int, int] | None = None, seq: int = 2048,
        measured_step_seconds: float | None = None) -> DryRunReport:
    """Compile one full-size step of `model` for `topology` and report what it costs per chip.

    The mesh is `("dp", "tp")`; by default `dp=2` (the guidance batch) and `tp` the rest of the
    chips, for LLMs `dp=1`. Bad arguments raise `DryRunError` before anything is built.
    """
    _validate(model, frames, sharding, attention, layers)
    topo = hardware.parse_topology(topology)
    n = topo.num_chips
    if mesh_shape is None:
        mesh_shape = (1, n) if model == "llama" or n == 1 else (2, n // 2)
    if math.prod(mesh_shape) != n:
        raise DryRunError(f"mesh {mesh_shape} needs {math.prod(mesh_shape)} chips; {topology} has {n}")
    width = height = None
    if model != "llama":
        width, height = parse_resolution(resolution, 16)
    if model == "cogvideox-vae":
        return _vae_report(topology, topo, width, height, frames)

    from tpupedia import torchax_utils

    env = torchax_utils.default_env()
    torchax_utils.register_common_outputs()
    mesh = devices.topology_mesh(topology, mesh_shape, ("dp", "tp"))
    builder = {"cogvideox": _cogvideox, "hunyuan": _hunyuan, "llama": _llama}[model]
    full_layers, module, inputs, call, flops = builder(layers, width, height, frames, seq, mesh)

    axis = "tp" if sharding.startswith("tp") else ("dp", "tp")  # FSDP shards over every chip
    table = sharding_rules.rules(model, sharding, axis=axis)
    try:
        the_plan = sharding_rules.plan(module, table, mesh)
    except sharding_rules.ShardingError as err:
        raise DryRunError(str(err)) from None
    functional = sharding_rules.FunctionalModule(module)
    weights, buffers = functional.abstract_state(the_plan)
    jm = functional._jm
    notes = []

    def step(w, b, *args):
        w, b, args = env.j2t_iso((w, b, args))
        with env:
            out = call(jm, w, b, *args)
        return env.t2j_iso(out)

    with torchax_utils.restoring_ops(env):  # the environment is shared: leave it as found
        if attention == "splash":
            _install_splash(env, mesh, model)
        else:
            torchax_utils.stock_ops(env)  # torchax's reference SDPA, whatever was installed before
        result = aot.compile_aot(step, weights, buffers, *inputs)

    compiled_layers = full_layers if layers is None else min(layers, full_layers)
    prefix = {"cogvideox": "transformer_blocks.0.", "hunyuan": "transformer_blocks.0.", "llama": "model.layers.0."}[model]
    per_layer = sum(p.bytes_per_device for p in the_plan.placements if p.name.startswith(prefix))
    extra = (full_layers - compiled_layers) * per_layer
    if extra:
        notes.append(f"compiled {compiled_layers} of {full_layers} layers; arguments include "
                     f"{full_layers - compiled_layers} more layers' weight shards ({extra / 2**30:.2f} GiB per chip, "
                     "from their shapes); temporaries are as compiled for the shallow copy (full depth may need more)")
    chip = topo.chip
    hbm = aot.hbm_budget(mesh.devices.flat)  # what the compiler lets a program use per chip
    mem = result.memory
    args_bytes = mem.arguments + extra if mem else None
    fits = result.fits
    if fits and mem.arguments + extra + mem.temporaries + mem.outputs > hbm:
        fits = False
        notes.append("the compiled shallow copy fits, but the full depth's weights do not")
    weight_bytes_per_chip = (mem.arguments + extra) if mem else the_plan.bytes_per_device + extra
    roofline = max(flops["total"] / (n * chip.bf16_flops), weight_bytes_per_chip / chip.hbm_bytes_per_s)
    mfu = None
    if measured_step_seconds:
        mfu = flops["total"] / (measured_step_seconds * n * chip.bf16_flops)
    return DryRunReport(
        model=model, topology=topology, chip=chip.name, num_chips=n, mesh=dict(mesh.shape),
        sharding=sharding, attention=attention, width=width, height=height,
        frames=frames if model != "llama" else None, tokens=int(flops["tokens"]),
        layers_full=full_layers, layers_compiled=compiled_layers, hbm_bytes=hbm, fits=fits,
        arguments_bytes=args_bytes, temporaries_bytes=mem.temporaries if mem else None,
        outputs_bytes=mem.outputs if mem else None,
        oom_required_bytes=result.oom_required_bytes, oom_available_bytes=result.oom_available_bytes,
        collectives=result.collectives, flops=flops, roofline_seconds=roofline,
        measured_step_seconds=measured_step_seconds, mfu=mfu, notes=notes,
    )


# The mask each model hands to SDPA, declared so that the splash path does not also compile a
# full-size reference branch for the run-time check (`tpupedia.attention`, mask_structure):
# HunyuanVideo-1.5 builds valid(q) & valid(k) from its text mask; Llama a causal mask.
_MASK_STRUCTURE = {"cogvideox": "padding", "hunyuan": "padding", "llama": "causal_padding"}


def _install_splash(env, mesh, model: str) -> None:
    """Route SDPA to the compiled (not interpreted) splash kernel, heads split over `tp`."""
    from tpupedia import attention

    attention.install_attention(env, mesh=mesh, backend="splash", interpret=False,
                                mask_structure=_MASK_STRUCTURE[model], batch_axis="dp", head_axis="tp")


def _abstract_inputs(mesh, specs):
    from jax.sharding import NamedSharding

    return [aot.abstract(shape, dtype, NamedSharding(mesh, spec)) for shape, dtype, spec in specs]


def _cogvideox(layers, width, height, frames, seq, mesh):
    import jax.numpy as jnp
    import torch
    from diffusers import CogVideoXTransformer3DModel
    from jax.sharding import PartitionSpec as P

    config = cogvideox_config(layers)
    with torch.device("meta"):
        module = CogVideoXTransformer3DModel(**config).to(torch.bfloat16)
    latent_frames = (frames - 1) // 4 + 1
    latent_frames += latent_frames % 2  # the pipeline pads to a multiple of patch_size_t
    video_tokens = (latent_frames // 2) * (height // 16) * (width // 16)
    inputs = _abstract_inputs(mesh, [
        ((CFG_BATCH, latent_frames, 16, height // 8, width // 8), jnp.bfloat16, P("dp")),
        ((CFG_BATCH, 226, 4096), jnp.bfloat16, P("dp")),
        ((CFG_BATCH,), jnp.int32, P("dp")),
        ((video_tokens, 64), jnp.float32, P()),
        ((video_tokens, 64), jnp.float32, P()),
    ])

    def call(jm, w, b, x, text, t, cos, sin):
        return jm.functional_call("forward", w, b, hidden_states=x, encoder_hidden_states=text, timestep=t,
                                  image_rotary_emb=(cos, sin), return_dict=False)[0]

    flops = cogvideox_step_flops(width, height, frames, layers=42)
    return 42, module, inputs, call, flops


def _hunyuan(layers, width, height, frames, seq, mesh):
    import jax.numpy as jnp
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel
    from jax.sharding import PartitionSpec as P

    from tpupedia.models.hunyuan_static import static_forward

    with torch.device("meta"):
        module = HunyuanVideo15Transformer3DModel(**hunyuan_config(layers)).to(torch.bfloat16)
    t = (frames - 1) // 4 + 1
    inputs = _abstract_inputs(mesh, [
        ((CFG_BATCH, 65, t, height // 16, width // 16), jnp.bfloat16, P("dp")),
        ((CFG_BATCH,), jnp.int32, P("dp")),
        ((CFG_BATCH, 1000, 3584), jnp.bfloat16, P("dp")),
        ((CFG_BATCH, 1000), jnp.int32, P("dp")),
        ((CFG_BATCH, 256, 1472), jnp.bfloat16, P("dp")),
        ((CFG_BATCH, 256), jnp.int32, P("dp")),
        ((CFG_BATCH, 729, 1152), jnp.bfloat16, P("dp")),
    ])

    def call(jm, w, b, x, ts, text, mask, text2, mask2, image):
        return jm.functional_call(static_forward, w, b, x, ts, text, mask, encoder_hidden_states_2=text2,
                                  encoder_attention_mask_2=mask2, image_embeds=image, return_dict=False)[0]

    flops = hunyuan_step_flops(width, height, frames, layers=54)
    return 54, module, inputs, call, flops


def _llama(layers, width, height, frames, seq, mesh):
    import jax.numpy as jnp
    import torch
    from jax.sharding import PartitionSpec as P
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        module = LlamaForCausalLM(LlamaConfig(**llama_config(layers))).to(torch.bfloat16)
    inputs = _abstract_inputs(mesh, [((1, seq), jnp.int32, P())])

    def call(jm, w, b, ids):
        return jm.functional_call("forward", w, b, ids, return_dict=False)[0]

    return 32, module, inputs, call, llama_forward_flops(seq)


def _record_key(r: dict[str, Any]) -> tuple:
    return (r["model"], r["topology"], r["width"], r["height"], r["frames"], r["tokens"], r["sharding"],
            r["attention"], r["layers_compiled"], tuple(sorted(r["mesh"].items())))


def record(report: DryRunReport, path: str = DEFAULT_RECORDS, command: str = "") -> Any:
    """Merge `report` into the dry-run results file the docs' results page renders."""
    import datetime as _dt
    import importlib.metadata as md

    from tpupedia import bench

    data = report.as_dict() | {
        "compiled_at": _dt.date.today().isoformat(),
        "libtpu": md.version("libtpu") if devices.has_libtpu() else None,
        "command": command,
    }
    return bench.merge_record(data, path, key=_record_key)


def _vae_report(topology: str, topo, width: int, height: int, frames: int) -> DryRunReport:
    """One frame batch of the CogVideoX VAE decoder (Flax NNX port, bf16) on one chip."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from tpupedia.models import cogvideox_vae_convert as convert
    from tpupedia.models.cogvideox_vae import CogVideoXVAEConfig

    config = CogVideoXVAEConfig()
    ratio = config.spatial_compression_ratio
    if width % ratio or height % ratio:
        raise DryRunError(f"resolution {width}x{height}: the VAE needs multiples of {ratio}")
    device = devices.tpu_topology(topology)[0]
    chip_sharding = SingleDeviceSharding(device)
    model = convert.abstract_vae(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    graph, state = nnx.split(model)
    state = jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, chip_sharding), state)
    latents = aot.abstract((1, 2, height // ratio, width // ratio, config.latent_channels), jnp.bfloat16, chip_sharding)

    def decode(st, z):
        return nnx.merge(graph, st).decode_chunk(z, None)[0]

    # XLA's FLOP count of the same program lowered for the host (no compile, no data)
    host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, latents))
    cost = jax.jit(decode).lower(*host).cost_analysis()
    total = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    result = aot.compile_aot(decode, state, latents)
    flops = {"tokens": 2 * (height // ratio) * (width // ratio), "linear": total, "attention": 0.0, "total": total}
    chip = topo.chip
    hbm = aot.hbm_budget([device])
    mem = result.memory
    weights = sum(a.size * 2 for a in jax.tree.leaves(state))
    return DryRunReport(
        model="cogvideox-vae", topology=topology, chip=chip.name, num_chips=1, mesh={"chip": 1},
        sharding="replicated", attention="none", width=width, height=height, frames=frames,
        tokens=int(flops["tokens"]), layers_full=1, layers_compiled=1, hbm_bytes=hbm, fits=result.fits,
        arguments_bytes=mem.arguments if mem else None, temporaries_bytes=mem.temporaries if mem else None,
        outputs_bytes=mem.outputs if mem else None, oom_required_bytes=result.oom_required_bytes,
        oom_available_bytes=result.oom_available_bytes, collectives=result.collectives, flops=flops,
        roofline_seconds=max(flops["total"] / chip.bf16_flops, weights / chip.hbm_bytes_per_s),
        notes=["one frame batch (2 latent frames -> 8 video frames) of the Flax NNX decoder (notebook 05), "
               "bf16, untiled, on one chip; FLOPs are XLA's count of the program lowered for the host"],
    )
