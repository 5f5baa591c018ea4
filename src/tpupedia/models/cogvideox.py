"""CogVideoX: every fact about the family in one place.

Configs (tiny for CPU, full for CogVideoX1.5-5B), the frame and size rules, latent and token
counts, the analytic FLOPs of one denoising step, how to build the transformer on `meta` for an
AOT dry-run, and how to write and load a checkpoint. `tpupedia.dryrun`, `tpupedia.bench`, the
docs and `tpupedia.pipelines.cogvideox` read these; nothing else spells a CogVideoX fact.

Introduced in notebook `cogvideox_pipeline` (CogVideoX text-to-video in three stages); the dry-run of notebook `plan_without_tpu`
reads the same facts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from tpupedia.models import ModelInputError, checkpoints, tokenizer_files
from tpupedia.models.shapes import ShapeFacts
from tpupedia.models.spec import FamilySpec, QuotedFigure

__all__ = ["QUANTIZE_KEEP", "REPORTED_STEPS", "REPORTED_STAGES",
    "FAMILY", "FULL_ID", "FULL_ID_I2V", "FULL_LAYERS", "CACHE_BLOCKS", "CACHE_TEXT_STREAM", "TEMPORAL_COMPRESSION", "SPATIAL_COMPRESSION", "PATCH_SIZE",
    "PATCH_SIZE_T", "LATENT_CHANNELS", "DEFAULT_SHAPES", "shape_facts", "TEXT_TOKENS", "CFG_BATCH", "SPLASH_BLOCK_SIZES",
    "SCHEDULER_CONFIG", "SHARDING", "SPEC", "ModelInputError", "dynamic_guidance",
    "full_transformer_config", "tiny_transformer_config", "attention_call", "i2v_transformer_config", "image_to_video",
    "tiny_vae_config", "tiny_text_encoder_config",
    "full_text_encoder_config", "default_request", "check_frames", "check_size", "latent_frames",
    "padded_latent_frames", "video_tokens", "step_flops", "bench_step", "build", "step_inputs", "FunctionalRoPEAttnProcessor",
    "make_jit_friendly", "SMALL_ID", "SMALL_TRANSFORMER", "SMALL_SCHEDULER", "RELEASE_REQUESTS",
    "tiny_checkpoint", "model_source", "named_source", "component_configs", "load_scheduler", "rotary_embeddings",
]

FAMILY = "cogvideox"
FULL_ID = "zai-org/CogVideoX1.5-5B"
FULL_ID_I2V = "zai-org/CogVideoX1.5-5B-I2V"
SMALL_ID = "zai-org/CogVideoX-2b"
"""CogVideoX 1.0's 2B text-to-video release (`--model`): 30 layers of 30 heads, sinusoidal
positions instead of RoPE, no temporal patches, the DDIM scheduler; one that fits small hardware."""
FULL_LAYERS = 42
TEMPORAL_COMPRESSION = 4  # the VAE keeps the first frame and compresses the rest 4x in time
SPATIAL_COMPRESSION = 8  # and 8x in height and width
PATCH_SIZE = 2  # the transformer's 2x2 spatial patches
PATCH_SIZE_T = 2  # CogVideoX 1.5: 2 latent frames per patch (1.0 has none)
LATENT_CHANNELS = 16
DEFAULT_SHAPES = ShapeFacts(spatial=SPATIAL_COMPRESSION, temporal=TEMPORAL_COMPRESSION, patch=PATCH_SIZE,
                            patch_t=PATCH_SIZE_T, latent_channels=LATENT_CHANNELS)
"""CogVideoX1.5-5B's shape facts: the presets' and the dry-run's; a checkpoint's come from `shape_facts`."""
TEXT_TOKENS = 226  # the T5 text length of the released checkpoints (transformer max_text_seq_length)
CFG_BATCH = 2  # classifier-free guidance: the negative and the positive prompt in one batch
TEXT_ENCODERS = {"text_encoder": "t5"}
"""Each text encoder of the checkpoint and its `tpupedia.sharding` rule family (T5-XXL: 9.5 GB)."""
TRANSFORMER_CLASS = "CogVideoXTransformer3DModel"
"""The diffusers class of the transformer(s) the pipeline loads (`tpupedia.lora` builds it on `meta` to check an adapter)."""
LORA_LOADER = "CogVideoXLoraLoaderMixin"
"""diffusers' LoRA loader for this family's pipelines (`tpupedia.lora`: how `--lora` reads an adapter)."""
CACHE_BLOCKS = "transformer_blocks"
"""Step caches (`tpupedia.pipelines.stepcache`): the transformer's block list a cached step
skips, whose first block (FBCache), cut (DeepCache's tail) and last block cache."""
CACHE_TEXT_STREAM = True
"""Step caches: a `CogVideoXBlock` returns `(video, text)`: both streams are cached (diffusers registers it for FirstBlockCache and MagCache with `return_encoder_hidden_states_index=1`)."""
SPLASH_BLOCK_SIZES = (3328, 2816, 256)
"""Splash `(block_q, block_kv, block_kv_compute)` for the transformer's joint attention: upstream's
tuned sizes (yangwhale/gpu-tpu-pedia at 3fa9ce1, `tpu/CogVideoX/generate_diffusers_torchax_staged/utils.py`,
reported upstream +16.2% on a TPU v6e-8). Our kernel at these sizes compiles for v6e within its
VMEM at the release shape (AOT: `tests/test_plan.py` plans the release's denoise step with
them); `--block-sizes` overrides."""

REPORTED_STEPS = (
    dict(resolution="1280x720", frames=81, mesh=(2, 4), sharding="tp", step_s=2.13, steps=50,
         source="tpu/CogVideoX/README.md (one file, TorchAx VAE, dp2 tp4: 106.47 s for 50 steps, the whole run)"),
)
"""Step times reported upstream on a TPU v6e-8 (yangwhale/gpu-tpu-pedia, commit 3fa9ce1), with the
mesh and sharding table the run used: what `tpupedia.predict` sets its predictions against (the
results page; `docs/results/upstream.json` holds the same runs, checked equal by tests/test_predict.py)."""

REPORTED_STAGES = (
    dict(stage="decode", what="run", resolution="1280x720", frames=81, seconds=0.86,
         source="tpu/CogVideoX/README.md (three stages, 720x1280, 81 frames: TorchAx VAE, later runs)"),
    dict(stage="decode", what="run", resolution="1360x768", frames=81, seconds=0.65,
         source="tpu/CogVideoX/README.md (three stages, 768x1360, 81 frames: TorchAx VAE, later runs)"),
    dict(stage="denoise", what="run", resolution="1360x768", frames=81, seconds=56.6,
         source="tpu/CogVideoX/README.md (three stages, 768x1360: stage 2 later runs, 56.6 s for 50 steps; upstream "
                "itself notes that its 720x1280 run, with fewer pixels, took 103.8 s, and suspects the conditions)"),
    dict(stage="denoise", what="run", resolution="1280x720", frames=81, seconds=103.8,
         source="tpu/CogVideoX/README.md (three stages, 720x1280: stage 2 later runs, ~103.8 s for 50 steps, the "
                "steps alone where the one-file 106.47 s adds the text encoder and the VAE)"),
    dict(stage="denoise", what="compile", resolution="1280x720", frames=81, seconds=130,
         source="tpu/CogVideoX/README.md (three stages, 720x1280: stage 2 JIT ~130 s)"),
    dict(stage="denoise", what="compile", resolution="1360x768", frames=81, seconds=137,
         source="tpu/CogVideoX/README.md (three stages, 768x1360: stage 2 JIT ~137 s)"),
    dict(stage="decode", what="compile", resolution="1280x720", frames=81, seconds=80,
         source="tpu/CogVideoX/README.md (three stages, 720x1280: TorchAx VAE JIT ~80 s)"),
    dict(stage="decode", what="compile", resolution="1360x768", frames=81, seconds=126,
         source="tpu/CogVideoX/README.md (three stages, 768x1360: TorchAx VAE JIT ~126 s)"),
)
"""Stage times other than a denoising step reported upstream on a TPU v6e-8, mesh dp=2, tp=4
(yangwhale/gpu-tpu-pedia, commit 3fa9ce1): a stage's run time in one video (`what="run"`) or its
programs' compile time (`"compile"`, on the TPU VM's host), what `tpupedia plan`'s predictions are
set against (`tpupedia.predict.reported_stage`). The text stage's ~2 s is left out: it is the
stage script's wall time, weights loading included."""


# Sharding tables for the transformer (diffusers `CogVideoXTransformer3DModel` names; notebook `sharding`
# teaches the strategies, `tpupedia.sharding.rules` reads a table). The FFN's first projection is
# `ff.net.0.proj` in diffusers (upstream's tables name `ff.net.0`, which matches nothing:
# docs/kb/corrections.md, entry 3).
_COL = r"(attn1\.to_q|attn1\.to_k|attn1\.to_v|ff\.net\.0\.proj)"
_ROW = r"(attn1\.to_out\.0|ff\.net\.2)"
QUANTIZE_KEEP: tuple[tuple[str, str], ...] = (
    (r"patch_embed\..*", "the patch and text embedders: the first layers, whose errors every block inherits"),
    (r"time_embedding\..*", "the timestep embedding: 1.8 M weights that condition every block"),
    (r"transformer_blocks\.\d+\.norm\d\.linear", "adaLN modulation: its output scales and shifts every token of the block's input, so its error moves a whole activation, not one output channel's share"),
    (r"norm_out\.linear|proj_out", "the last modulation and the projection to latents: their errors are the prediction's"),
)
"""The transformer's linears `--quantize` keeps in the checkpoint's dtype (`tpupedia.quantize`), each
regex with its reason; every other linear is quantized. A starting table from where errors spread,
not from frames measured on real weights (none were measured here)."""

SHARDING: dict[str, list] = {
    "tp": [
        (rf".*\.{_COL}\.weight", ("tp", None)),
        (rf".*\.{_COL}\.bias", ("tp",)),
        (rf".*\.{_ROW}\.weight", (None, "tp")),
    ],
    "tp_transposed": [  # what upstream labels "TP"; biases stay replicated
        (rf".*\.{_COL}\.weight", (None, "tp")),
        (rf".*\.{_ROW}\.weight", ("tp", None)),
    ],
    "fsdp": [
        (rf".*\.({_COL[1:-1]}|{_ROW[1:-1]})\.weight", ("fsdp", None)),
    ],
    "replicated": [],
}

SPEC = FamilySpec(
    name=FAMILY, module=__name__, full_id=FULL_ID, sharding=SHARDING, mask="padding",
    title="CogVideoX (1.5-5B on the full preset): T5 -> transformer -> VAE",
    releases={FULL_ID: {}, FULL_ID_I2V: {"image_to_video": True}, SMALL_ID: {"size": "2b"}},
    figures=(QuotedFigure("plan.cogvideox.decode_gib", "plan_peak", stage="decode", decimals=2,
                          match={"family": FAMILY, "topology": "v6e:2x4", "layers": None, "vae_tiling": False,
                                 "stages": ("decode",)},
                          source="docs/results/plans.json: tpupedia plan cogvideox --stages decode (AOT here, a v6e "
                                 "host's 4 chips)"),),
)
"""This family in the registry (`tpupedia.families`)."""

# The scheduler of the CogVideoX1.5-5B checkpoint (scheduler/scheduler_config.json on the Hub:
# CogVideoXDPMScheduler, v-prediction, zero-SNR rescaled betas, trailing timesteps).
SCHEDULER_CONFIG: dict[str, Any] = dict(
    beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
    num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
    set_alpha_to_one=True, snr_shift_scale=1.0, steps_offset=0, timestep_spacing="trailing",
)


# CogVideoX-2b's transformer: huggingface/diffusers scripts/convert_cogvideox_to_diffusers.py
# (commit 01337da7633c4c663e76e75550e6f9d94fa7dc97): "For CogVideoX-2B, num_layers is 30 ... num_attention_heads
# is 30 ... use_rotary_positional_embeddings is False", the rest `CogVideoXTransformer3DModel`'s defaults
# (64-wide heads, 2x2 patches and no temporal patch, sample 90x60 latents of 49 frames, time embedding 512,
# T5 width 4096 over 226 tokens, sinusoidal positions).
SMALL_TRANSFORMER: dict[str, Any] = dict(
    activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64, in_channels=16, out_channels=16,
    max_text_seq_length=TEXT_TOKENS, norm_elementwise_affine=True, norm_eps=1e-5, num_attention_heads=30,
    num_layers=30, patch_size=2, patch_size_t=None, patch_bias=True, sample_frames=49, sample_height=60,
    sample_width=90, spatial_interpolation_scale=1.875, temporal_compression_ratio=TEMPORAL_COMPRESSION,
    temporal_interpolation_scale=1.0, text_embed_dim=4096, time_embed_dim=512, timestep_activation_fn="silu",
    use_learned_positional_embeddings=False, use_rotary_positional_embeddings=False, flip_sin_to_cos=True,
    freq_shift=0,
)
# CogVideoX-2b's scheduler and VAE scale: the same conversion script ("For CogVideoX-2B, scaling_factor is
# 1.15258426", "snr_shift_scale is 3.0", CogVideoXDDIMScheduler).
SMALL_SCHEDULER: dict[str, Any] = dict(SCHEDULER_CONFIG, snr_shift_scale=3.0)
SMALL_VAE_SCALING = 1.15258426
RELEASE_REQUESTS: dict[str, dict[str, Any]] = {
    # CogVideoX-2b's model card and diffusers' CogVideoXPipeline defaults: 720x480, 49 frames at 8 fps, 50 steps,
    # guidance 6.
    SMALL_ID: dict(frames=49, height=480, width=720, fps=8, steps=50, guidance=6.0),
}
"""Each built-in release whose default video differs from the full preset's (`default_request`):
the fields `tpupedia plan --model ID` starts from (`StagedPipeline.release_request`)."""


def dynamic_guidance(guidance: float, steps: int, timestep: float) -> float:
    """The guidance scale stock `CogVideoXPipeline(use_dynamic_cfg=True)` uses at `timestep`
    (diffusers 0.42.1, `pipeline_cogvideox.py`): `1 + g * (1 - cos(pi * ((steps - t) / steps) ** 5)) / 2`.
    `t` is the scheduler's timestep (999 down to 0), not the step's index, so the ramp is not the
    0-to-1 one the formula reads as: with 50 steps `(steps - t) / steps` runs from about -19 to 1
    and the scale swings between 1 and 1 + g. Kept as stock computes it, for the same video. The
    CogVideoX authors sample with it and their DPM scheduler (THUDM/CogVideo
    `inference/cli_demo.py` @ 01f19dad: `use_dynamic_cfg=True`, guidance 6)."""
    import math

    return 1 + guidance * ((1 - math.cos(math.pi * ((steps - float(timestep)) / steps) ** 5.0)) / 2)


def full_transformer_config(layers: int | None = None, size: str = "1.5-5b") -> dict[str, Any]:
    """CogVideoX1.5-5B transformer (diffusers `CogVideoXTransformer3DModel`), per its public
    config: 42 layers, 48 heads of 64, patch 2x2 and 2 frames, T5 text width 4096; `size="2b"`:
    CogVideoX-2b's (`SMALL_TRANSFORMER`). `layers` overrides the depth (a shallow plan)."""
    if size == "2b":
        return SMALL_TRANSFORMER | ({} if layers is None else {"num_layers": layers})
    if size != "1.5-5b":
        raise ModelInputError(f"size={size!r} is not one of 1.5-5b, 2b")
    return dict(
        activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64,
        in_channels=16, out_channels=16, max_text_seq_length=TEXT_TOKENS, norm_elementwise_affine=True,
        norm_eps=1e-5, num_attention_heads=48, num_layers=FULL_LAYERS if layers is None else layers,
        patch_size=PATCH_SIZE, patch_size_t=PATCH_SIZE_T, patch_bias=False, sample_frames=81, sample_height=300,
        sample_width=300, spatial_interpolation_scale=1.875, temporal_compression_ratio=TEMPORAL_COMPRESSION,
        temporal_interpolation_scale=1.0, text_embed_dim=4096, time_embed_dim=512,
        timestep_activation_fn="silu", use_learned_positional_embeddings=False,
        use_rotary_positional_embeddings=True, flip_sin_to_cos=True, freq_shift=0,
    )


def full_text_encoder_config() -> dict[str, Any]:
    """The T5 v1.1 XXL encoder CogVideoX uses (`T5Config` fields): 24 layers, width 4096."""
    return dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)


def full_configs(image_to_video: bool = False, size: str = "1.5-5b") -> dict[str, dict]:
    """The released checkpoint's component configs, as `component_configs` reads them from a
    download, for planning without one (`tpupedia plan`): the transformer and T5 above, the VAE at
    diffusers' defaults (CogVideoX1.5's shapes; its scaling factor, 0.7, changes no shape), and the
    DPM scheduler by class (its values change the schedule, not a shape). `image_to_video`: the
    I2V release's (`i2v_transformer_config`). `size="2b"`: CogVideoX-2b (`SMALL_ID`: its
    transformer, VAE scale and DDIM scheduler; the same T5 and VAE shapes)."""
    import torch
    from diffusers import AutoencoderKLCogVideoX
    from transformers import T5Config

    if size == "2b":
        return _small_configs()
    with torch.device("meta"):
        vae = dict(AutoencoderKLCogVideoX().config)
    transformer = full_transformer_config()
    if image_to_video:
        transformer = i2v_transformer_config(transformer, vae["latent_channels"])
    return {"transformer": {"_class_name": "CogVideoXTransformer3DModel"} | transformer,
            "text_encoder": T5Config(**full_text_encoder_config()).to_dict(),
            "vae": vae | {"scaling_factor": 0.7},
            "scheduler": {"_class_name": "CogVideoXDPMScheduler", "prediction_type": "v_prediction",
                          "rescale_betas_zero_snr": True, "timestep_spacing": "trailing", "snr_shift_scale": 1.0}}


def _small_configs() -> dict[str, dict]:
    """CogVideoX-2b's component configs (`full_configs(size="2b")`): what `component_configs`
    would read from its download."""
    import torch
    from diffusers import AutoencoderKLCogVideoX
    from transformers import T5Config

    with torch.device("meta"):
        vae = dict(AutoencoderKLCogVideoX().config)
    return {"transformer": {"_class_name": "CogVideoXTransformer3DModel"} | full_transformer_config(size="2b"),
            "text_encoder": T5Config(**full_text_encoder_config()).to_dict(),
            "vae": vae | {"scaling_factor": SMALL_VAE_SCALING},
            "scheduler": {"_class_name": "CogVideoXDDIMScheduler"} | SMALL_SCHEDULER}


def tiny_transformer_config() -> dict[str, Any]:
    """The 1.5 layout at toy width: 2 layers, 4 heads of 16. Head dim 16 is the smallest that
    diffusers' 3-D RoPE accepts (it splits the head dim 1/4 time, 3/8 height, 3/8 width, each even)."""
    return dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=2, sample_width=4, sample_height=4, sample_frames=9,
        patch_size=PATCH_SIZE, patch_size_t=PATCH_SIZE_T, temporal_compression_ratio=TEMPORAL_COMPRESSION,
        max_text_seq_length=16, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
    )


def i2v_transformer_config(config: dict[str, Any], latent_channels: int) -> dict[str, Any]:
    """`config` (a text-to-video transformer's) in the image-to-video layout of CogVideoX1.5-5B-I2V
    (its `transformer/config.json` on the Hugging Face Hub): the picture's latents enter beside the
    noisy latents, so the input has twice the VAE's latent channels (32 for 16); the 1.5 layout
    adds an `ofs` embedding as wide as the timestep's (512 there)."""
    out = config | {"in_channels": 2 * latent_channels}
    if config.get("patch_size_t") is not None:
        out["ofs_embed_dim"] = config["time_embed_dim"]
    return out


def image_to_video(configs: dict[str, dict]) -> bool:
    """Whether a checkpoint (its component configs) generates from a picture: its transformer
    takes the picture's latents beside the noisy ones, twice the VAE's latent channels."""
    return configs["transformer"]["in_channels"] == 2 * configs["vae"]["latent_channels"]


def tiny_vae_config() -> dict[str, Any]:
    """A 4-level `AutoencoderKLCogVideoX` (8x spatial, 4x temporal, like the full one) 8 channels wide."""
    return dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
                temporal_compression_ratio=TEMPORAL_COMPRESSION, down_block_types=("CogVideoXDownBlock3D",) * 4,
                up_block_types=("CogVideoXUpBlock3D",) * 4)


def tiny_text_encoder_config() -> dict[str, Any]:
    """A 2-layer T5 encoder over the tiny SentencePiece vocabulary (`tokenizer_files.write_t5_spiece`:
    at most 96 pieces + 100 extra ids, in 256 embedding rows, as 32,100 ids sit in 32,128 rows)."""
    return dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)


def default_request(preset: Any) -> dict[str, Any]:
    """Frames, size, steps, guidance, seed and fps a preset generates by default: the tiny
    preset seconds on a CPU; the full preset the model authors' text-to-video resolution for
    CogVideoX1.5-5B, 1360x768 (its model card on the Hugging Face Hub), 81 frames, 50 steps at
    16 fps. 1280x720, the size upstream's timings use, stays an option (`--width/--height`)."""
    if preset.pretrained:
        return dict(frames=81, height=768, width=1360, steps=50, guidance=6.0, seed=42, fps=16)
    return dict(frames=9, height=32, width=32, steps=4, guidance=6.0, seed=42, fps=8)


def shape_facts(configs: dict[str, dict]) -> ShapeFacts:
    """A checkpoint's shape facts from its component configs, as `CogVideoXPipeline` reads them:
    spatial compression 2^(VAE blocks - 1), the VAE's `temporal_compression_ratio`, the
    transformer's `patch_size`/`patch_size_t` and `in_channels` (the latents it denoises; half of
    them for an image-to-video checkpoint, as `CogVideoXImageToVideoPipeline` reads them)."""
    vae, transformer = configs["vae"], configs["transformer"]
    channels = int(transformer["in_channels"])
    return ShapeFacts(spatial=2 ** (len(vae["block_out_channels"]) - 1), temporal=int(vae["temporal_compression_ratio"]),
                      patch=int(transformer["patch_size"]), patch_t=transformer.get("patch_size_t"),
                      latent_channels=channels // 2 if image_to_video(configs) else channels)


def check_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a frame count the VAE cannot produce: it must be temporal * n + 1 (4n+1 for the released VAE)."""
    if not facts.frames_ok(frames):
        t = facts.temporal
        raise ModelInputError(
            f"frames={frames}: CogVideoX generates {t}n+1 frames (the VAE keeps the first frame and "
            f"compresses the rest {t}x in time), e.g. {t * 2 + 1}, {t * 12 + 1}, {t * 20 + 1}. With CogVideoX 1.5 "
            f"(patch_size_t=2) diffusers pads an odd latent count by one latent frame and drops it after denoising "
            f"(CogVideoXPipeline.__call__, diffusers 0.42); the model authors recommend 16n+1 frames, n <= 10, for 1.5.")


def check_size(width: int, height: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a size the VAE and the patches cannot tile: positive multiples of spatial * patch (16)."""
    if not facts.size_ok(width, height):
        raise ModelInputError(f"size {width}x{height}: width and height must be positive multiples of "
                              f"{facts.size_multiple} (the VAE's {facts.spatial}x times the {facts.patch}x{facts.patch} patches)")


def latent_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> int:
    """Latent frames for `frames` video frames: (F - 1) / 4 + 1 for the released VAE."""
    return facts.latent_frames(frames)


def padded_latent_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> tuple[int, int]:
    """`(latent frames the transformer sees, padding frames)`: CogVideoX 1.5 pads to a multiple
    of `patch_size_t` at the front, as diffusers does, and drops the padding before decoding."""
    count = facts.latent_frames(frames)
    padding = (-count) % facts.patch_t if facts.patch_t else 0
    return count + padding, padding


def video_tokens(width: int, height: int, frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> int:
    """Video tokens of one sample: temporal patches x (H/16) x (W/16)."""
    padded, _ = padded_latent_frames(frames, facts)
    per = facts.size_multiple
    return padded // (facts.patch_t or 1) * (height // per) * (width // per)


def attention_call(width: int, height: int, frames: int, configs: dict[str, dict]) -> tuple[int, int]:
    """`(heads, tokens)` of one sample's joint attention in the transformer of `configs`: its
    heads, and the video tokens of the request (`video_tokens`, the checkpoint's shape facts)
    followed by its `max_text_seq_length` text tokens (`tpupedia.plan.gpu_attention` sizes the
    reference attention's scores from it)."""
    transformer = configs["transformer"]
    text = int(transformer.get("max_text_seq_length", TEXT_TOKENS))
    return int(transformer["num_attention_heads"]), video_tokens(width, height, frames, shape_facts(configs)) + text


def step_flops(width: int, height: int, frames: int, layers: int = FULL_LAYERS, batch: int = CFG_BATCH,
               heads: int = 48, head_dim: int = 64, text_tokens: int = TEXT_TOKENS) -> dict[str, float]:
    """Matmul FLOPs of one transformer step (2 FLOPs per multiply-add).

    Per layer and token: q, k, v, out projections (4 d^2) and a 4x MLP (8 d^2), times 2 FLOPs;
    attention: QK^T and PV, 2 * 2 * S^2 * d per layer. Embeddings and norms are ignored (<1%).
    """
    d = heads * head_dim
    s = math.ceil(latent_frames(frames) / PATCH_SIZE_T) * (height // 16) * (width // 16) + text_tokens
    linear = batch * layers * 2 * s * 12 * d * d
    attention = batch * layers * 4 * s * s * d
    return {"tokens": s, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def bench_step(layers: int, heads: int, head_dim: int, frames: int, height: int, width: int, text_tokens: int,
               seed: int = 0) -> tuple[Any, dict, dict[str, float]]:
    """A random CogVideoX1.5-shaped transformer (patch 2x2x2, 4x MLP, joint text-video attention)
    at the given width and depth, float32, and one denoising step's inputs (CFG batch 2):
    `(model, forward keyword arguments, step_flops)`, for `tpupedia bench dit` (notebook `plan_without_tpu`).
    The full model is `layers=42, heads=48, head_dim=64`."""
    import torch
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    check_frames(frames)
    check_size(width, height)
    full = full_transformer_config(layers)
    full.update(num_attention_heads=heads, attention_head_dim=head_dim, text_embed_dim=4 * heads * head_dim // 3 or 64,
                max_text_seq_length=text_tokens, sample_height=height // 8, sample_width=width // 8, sample_frames=frames)
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**full).eval()
    latent_frames, _ = padded_latent_frames(frames)
    g = torch.Generator().manual_seed(seed)
    grid = (height // 16, width // 16)
    inputs = dict(hidden_states=torch.randn(2, latent_frames, 16, height // 8, width // 8, generator=g),
                  encoder_hidden_states=torch.randn(2, text_tokens, full["text_embed_dim"], generator=g),
                  timestep=torch.tensor([500, 500]),
                  image_rotary_emb=get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=None, grid_size=grid,
                                                           temporal_size=latent_frames // 2, grid_type="slice",
                                                           max_size=grid))
    flops = step_flops(width, height, frames, layers=layers, heads=heads, head_dim=head_dim, text_tokens=text_tokens)
    return model, inputs, flops


def build(layers: int | None = None, device: str = "meta", dtype: Any = None):
    """The full-size transformer (shapes only on `meta`), bf16 by default, with the attention
    processor the pipeline runs (`make_jit_friendly`)."""
    import torch
    from diffusers import CogVideoXTransformer3DModel

    with torch.device(device):
        module = CogVideoXTransformer3DModel(**full_transformer_config(layers)).to(dtype or torch.bfloat16)
    return make_jit_friendly(module)


def step_inputs(width: int, height: int, frames: int, batch: int = CFG_BATCH) -> tuple[list, Any]:
    """`(input specs, call)` for one denoising step of the full model in the dry-run: latents
    (padded latent frames), T5 embeddings and timesteps with the guidance batch on `dp`, RoPE
    tables replicated."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    padded, _ = padded_latent_frames(frames)
    tokens = video_tokens(width, height, frames)
    head_dim = full_transformer_config()["attention_head_dim"]
    specs = [
        ((batch, padded, 16, height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION), jnp.bfloat16, P("dp")),
        ((batch, TEXT_TOKENS, 4096), jnp.bfloat16, P("dp")),
        ((batch,), jnp.int32, P("dp")),
        ((tokens, head_dim), jnp.float32, P()),
        ((tokens, head_dim), jnp.float32, P()),
    ]

    def call(fm, w, b, x, text, t, cos, sin):
        return fm(w, b, hidden_states=x, encoder_hidden_states=text, timestep=t, image_rotary_emb=(cos, sin),
                  return_dict=False)[0]

    return specs, call


# --- a jit-friendly attention processor -----------------------------------------------------

class FunctionalRoPEAttnProcessor:
    """diffusers' `CogVideoXAttnProcessor2_0` with the rotary embedding applied without
    in-place writes.

    The stock processor writes the rotated video part back into the query and key
    (`query[:, :, text_len:] = apply_rotary_emb(...)`). On a mesh whose `dp` axis splits the
    guidance batch, that in-place write gave wrong numbers: one attention layer 0.67 off PyTorch,
    the tiny transformer 0.04. Notebook `cogvideox_pipeline` section 5 reproduces it in plain JAX (`.at[].set` on
    an array whose heads are split over `tp`, then attention), so the fault is XLA's SPMD
    partitioner, not torchax (measured on CPU, jax 0.10.2). Concatenating the text part and the
    rotated video part gives PyTorch's values (3e-7). Everything else is the stock computation.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        import torch
        import torch.nn.functional as F
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise ModelInputError("CogVideoX attention takes no mask; got one")
        text_len = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        def split_heads(t):
            return t.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        q, k, v = split_heads(attn.to_q(x)), split_heads(attn.to_k(x)), split_heads(attn.to_v(x))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            def rotate_video(t):
                return torch.cat([t[:, :, :text_len], apply_rotary_emb(t[:, :, text_len:], image_rotary_emb)], dim=2)

            q = rotate_video(q)
            if not attn.is_cross_attention:
                k = rotate_video(k)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2)))
        return out[:, text_len:], out[:, :text_len]


def make_jit_friendly(transformer):
    """Install `FunctionalRoPEAttnProcessor` in every attention layer. Returns `transformer`."""
    transformer.set_attn_processor(FunctionalRoPEAttnProcessor())
    return transformer


# --- weights: tiny checkpoints and loading -------------------------------------------------------
# One loading path for both presets: `from_pretrained(..., use_safetensors=True)` on a diffusers
# directory or hub id. The tiny preset writes a random checkpoint with `save_pretrained` first.

ENV_MODEL = "TPUPEDIA_COGVIDEOX"
"""Environment variable naming a checkpoint (hub id or directory) to use instead of the preset's."""

SCHEDULERS = ("CogVideoXDPMScheduler", "CogVideoXDDIMScheduler")
def tiny_checkpoint(directory: "str | os.PathLike | None" = None, seed: int = 0, scheduler: str = "dpm",
                    patch_size_t: int | None = PATCH_SIZE_T, vae: dict | None = None,
                    transformer: dict | None = None, image_to_video: bool = False) -> "Path":
    """Write a whole random CogVideoX pipeline (T5 encoder with a SentencePiece tokenizer in the
    Hub's file layout, trained offline: `tokenizer_files.write_t5_spiece`; transformer, VAE,
    scheduler) with `save_pretrained` (safetensors) and return its directory
    (`tpupedia.models.checkpoints.cached_pipeline`: cached, named by its configs, written
    atomically). `patch_size_t=None` gives the CogVideoX 1.0 layout, 2 the 1.5 layout; `vae` and
    `transformer` override config entries (a checkpoint with other shape facts, for the tests).
    `image_to_video` writes a `CogVideoXImageToVideoPipeline` in CogVideoX1.5-5B-I2V's layout
    (`i2v_transformer_config`: the picture's latents as extra input channels, the `ofs` embedding).
    """
    classes = ("dpm", "ddim")
    if scheduler not in classes:
        raise ModelInputError(f"scheduler={scheduler!r} is not one of {', '.join(classes)}")
    text_length = tiny_transformer_config()["max_text_seq_length"]
    transformer_config = tiny_transformer_config() | {"patch_size_t": patch_size_t} | (transformer or {})
    vae_config = tiny_vae_config() | (vae or {})
    if image_to_video:
        transformer_config = i2v_transformer_config(transformer_config, vae_config["latent_channels"])
    spec = [transformer_config, vae_config, tiny_text_encoder_config(), SCHEDULER_CONFIG, scheduler, seed, "spiece",
            tokenizer_files.T5_CORPUS] + (["i2v"] if image_to_video else [])

    def write_tokenizer(folder):
        return tokenizer_files.write_t5_spiece(folder, max_length=text_length)

    def build():
        import tempfile

        import torch
        from diffusers import (
            AutoencoderKLCogVideoX,
            CogVideoXDDIMScheduler,
            CogVideoXDPMScheduler,
            CogVideoXImageToVideoPipeline,
            CogVideoXPipeline,
            CogVideoXTransformer3DModel,
        )
        from transformers import AutoTokenizer, T5Config, T5EncoderModel

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(tmp))
        torch.manual_seed(seed)
        return (CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline)(
            tokenizer=tokenizer,
            text_encoder=T5EncoderModel(T5Config(**tiny_text_encoder_config())).eval(),
            vae=AutoencoderKLCogVideoX(**vae_config).eval(),
            transformer=CogVideoXTransformer3DModel(**transformer_config).eval(),
            scheduler={"dpm": CogVideoXDPMScheduler, "ddim": CogVideoXDDIMScheduler}[scheduler](**SCHEDULER_CONFIG),
        )

    return checkpoints.cached_pipeline("cogvideox-i2v-tiny" if image_to_video else "cogvideox-tiny", spec, build, directory,
                                       finish=lambda path: write_tokenizer(path / "tokenizer"))


def model_source(preset: Any, model: "str | os.PathLike | None" = None,
                 image_to_video: bool = False) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$TPUPEDIA_COGVIDEOX`,
    else the preset's (`FULL_ID` for full, `FULL_ID_I2V` with `image_to_video`; the tiny
    checkpoint of that kind, labelled `preset:tiny` or `preset:tiny-i2v`)."""
    if image_to_video:
        source, label = checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID_I2V,
                                                  lambda: tiny_checkpoint(image_to_video=True))
        return source, (label + "-i2v" if label.startswith("preset:") else label)
    return checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID, tiny_checkpoint)


def named_source(model: "str | os.PathLike | None" = None) -> str | None:
    """The checkpoint the user named (`model`, else `$TPUPEDIA_COGVIDEOX`), or `None` for the preset's."""
    return checkpoints.named_source(model, ENV_MODEL)


def component_configs(source: str) -> dict[str, dict]:
    """The checkpoint's component configs (no weights read), minus version and path entries."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXTransformer3DModel
    from transformers import T5Config

    return checkpoints.read_configs(source, {
        "transformer": lambda s: CogVideoXTransformer3DModel.load_config(s, subfolder="transformer"),
        "vae": lambda s: AutoencoderKLCogVideoX.load_config(s, subfolder="vae"),
        "scheduler": lambda s: CogVideoXDPMScheduler.load_config(s, subfolder="scheduler"),
        "text_encoder": lambda s: T5Config.from_pretrained(s, subfolder="text_encoder").to_dict(),
    })


def load_scheduler(source: str):
    """The checkpoint's scheduler (its `model_index.json` names the class): DPM or DDIM."""
    import diffusers

    index = diffusers.DiffusionPipeline.load_config(source)
    name = index["scheduler"][1]
    if name not in SCHEDULERS:
        raise ModelInputError(f"scheduler {name!r} in {source}: the pipeline steps {', '.join(SCHEDULERS)}")
    return getattr(diffusers, name).from_pretrained(source, subfolder="scheduler")


def rotary_embeddings(transformer_config: dict, height: int, width: int, latent_frames: int,
                      facts: ShapeFacts = DEFAULT_SHAPES):
    """RoPE `(cos, sin)` for the video tokens, computed by diffusers' own
    `CogVideoXPipeline._prepare_rotary_positional_embeddings` (1.0 and 1.5 layouts) on the host."""
    from types import SimpleNamespace

    from diffusers import CogVideoXPipeline

    owner = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**transformer_config)),
                            vae_scale_factor_spatial=facts.spatial)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(owner, height, width, latent_frames, "cpu")
