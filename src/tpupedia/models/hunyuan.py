"""HunyuanVideo-1.5: the family's facts, a jit-friendly transformer forward, exact padding masks.

Facts: the 720p text-to-video checkpoint's transformer (54 dual-stream blocks, 16 heads of 128),
its frame rule (4n+1: the VAE compresses time by 4 and keeps the first frame) and size rule
(multiples of 16), latent shapes, the text slots every step carries (1000 Qwen2.5-VL tokens, 256
ByT5 glyph tokens, 729 image tokens, zeros for text-to-video), FLOPs of a step, tiny configs for
CPU (the same frame and size rules, the same special tokens), checkpoints, and how the dry-run
builds and calls it.

The forward: diffusers' `HunyuanVideo15Transformer3DModel.forward` (diffusers 0.42.1) cannot be
traced by `jax.jit`, for two reasons:

1. `is_t2v = torch.all(image_embeds == 0)` feeds a Python `if`, which asks a tracer for its
   truth value (`ConcretizationTypeError ... depends on the value of the argument image_embeds`);
2. the text tokens are reordered with boolean-mask indexing (`text[text_mask]`), whose output
   shape depends on the data.

`static_forward` keeps the computation and replaces the two constructs: the branch becomes a
`torch.where`, and the reorder becomes a stable argsort that puts valid tokens first in their
original order, followed by a gather, with the attention mask gathered the same way. On torch CPU
it is bit-identical to the stock forward, with and without padded tokens (tests/test_hunyuan.py).
Use it as `make_static(module)` or pass it to `JittableModule.functional_call`.

Masks: diffusers' attention processor turns the (B, S_text) padding vector into a (B, 1, S, S)
boolean matrix (`repeat` + `transpose`); at 121 frames of 720p that is 113,585^2 = 12.9 G elements
per sample. `PaddingAttnProcessor` keeps the vector and hands it to an `attend(q, k, v, valid)`
function: on torch the stock SDPA with the same mask (for the equality test), under torchax
`tpupedia.attention.padded_attention`, where splash takes the vector as segment ids.

DeepCache: `static_forward` is composed of `conditioning` (embeddings, text refiner, token
order), `blocks` and `final`; `deepcache_full` also returns the state entering the last `tail`
blocks, and `deepcache_cached` runs only those blocks from a cached state
(`tpupedia.pipelines.deepcache`).

Introduced for the dry-run planner of notebook `plan_without_tpu`; notebook `hunyuan_video` (HunyuanVideo-1.5 text-to-video)
explains and uses all of it.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

from tpupedia.models import ModelInputError, checkpoints, tokenizer_files
from tpupedia.models.shapes import ShapeFacts
from tpupedia.models.spec import FamilySpec, FewStepRelease, QuotedFigure

__all__ = ["QUANTIZE_KEEP", "REPORTED_STEPS", "SPLASH_PROFILE", "FAMILY", "FULL_ID", "FULL_LAYERS", "TEMPORAL_COMPRESSION", "SPATIAL_COMPRESSION", "PATCH_SIZE",
           "LATENT_CHANNELS", "DEFAULT_SHAPES", "SHARDING", "SPEC", "shape_facts", "TEXT_SLOTS", "SPLASH_BLOCK_SIZES", "ENV_MODEL", "ModelInputError",
           "full_transformer_config", "tiny_transformer_config", "tiny_vae_config", "tiny_text_encoder_configs",
           "tiny_qwen_tokenizer", "default_request", "check_frames", "check_size", "latent_frames", "latent_shape",
           "video_tokens", "sequence_tokens", "attention_call", "UPSTREAM_TEXT_TOKENS", "step_flops", "build", "step_inputs", "static_forward", "make_static",
           "PaddingAttnProcessor", "make_jit_friendly", "padded_forward", "conditioning", "blocks", "final", "deepcache_full",
           "deepcache_cached", "CACHE_BLOCKS", "CACHE_TEXT_STREAM", "KEEP_ALL_TEXT_BELOW", "kept_text_tokens", "mask_elements", "tiny_checkpoint", "model_source", "named_source", "component_configs",
           "FULL_ID_I2V", "image_to_video", "image_tokens", "video_size", "full_image_encoder_config",
           "tiny_image_encoder_config", "tiny_image_processor", "image_condition", "slot_tokens", "FULL_ID_STEP_DISTILLED",
           "STEP_DISTILLED", "FEW_STEP", "tiny_release_checkpoint", "tiny_release_adapters"]

FAMILY = "hunyuan"
FULL_ID = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"
FULL_ID_I2V = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v"
FULL_ID_STEP_DISTILLED = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v_step_distilled"
"""The step-distilled 480p image-to-video release in diffusers' layout (`use_meanflow`: each step also
embeds the next step's timestep); `--release step-distilled`."""
STEP_DISTILLED_TRANSFORMER = dict(target_size=640, task_type="i2v", use_meanflow=True)
"""What its transformer config sets (diffusers' conversion script, huggingface/diffusers PR #12802,
`TRANSFORMER_CONFIGS["480p_i2v_step_distilled"]`)."""
STEP_DISTILLED_SHIFT = 7.0
"""Its scheduler's shift (the same script's `SCHEDULER_CONFIGS["480p_i2v_step_distilled"]`)."""
STEP_DISTILLED_GUIDANCE = 1.0
"""Its guider's scale, guidance off (the same script's `GUIDANCE_CONFIGS["480p_i2v_step_distilled"]`)."""
TARGET_SIZE = 960
"""The 720p releases' `target_size` (diffusers' conversion script, `TRANSFORMER_CONFIGS`; 640 for
480p): the pixel scale image-to-video's size buckets are built around (`video_size`)."""
FULL_LAYERS = 54
TEMPORAL_COMPRESSION = 4
SPATIAL_COMPRESSION = 16  # the VAE (16x) times patch size 1: one token per latent pixel
PATCH_SIZE = 1
LATENT_CHANNELS = 32
DEFAULT_SHAPES = ShapeFacts(spatial=SPATIAL_COMPRESSION, temporal=TEMPORAL_COMPRESSION, patch=PATCH_SIZE,
                            patch_t=1, latent_channels=LATENT_CHANNELS)
"""The 720p checkpoint's shape facts: the presets' and the dry-run's; a checkpoint's come from `shape_facts`."""
ENV_MODEL = "TPUPEDIA_HUNYUAN"
"""Environment variable naming a checkpoint (hub id or directory) to use instead of the preset's."""
CACHE_BLOCKS = "transformer_blocks"
"""Step caches (`tpupedia.pipelines.stepcache`): the transformer's block list a cached step
skips, whose first block (FBCache), cut (DeepCache's tail) and last block cache."""
CACHE_TEXT_STREAM = True
"""Step caches: a dual-stream `HunyuanVideo15TransformerBlock` returns `(video, text)`: both streams are cached (diffusers 0.42 registers no HunyuanVideo-1.5 block for its caches; these are the same facts for this repository's)."""
TEXT_ENCODERS = {"text_encoder": "qwen2", "text_encoder_2": "t5"}
"""Each text encoder and its `tpupedia.sharding` rule family (Qwen2.5-VL's text model, 15.2 GB,
in Llama naming; ByT5 for quoted glyph text)."""
TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"
"""The diffusers class of the transformer(s) the pipeline loads (`tpupedia.lora` builds it on `meta` to check an adapter)."""
LORA_LOADER = None
"""diffusers' HunyuanVideo-1.5 pipelines expose no LoRA loader: `--lora` goes through the transformer's own
`load_lora_adapter` (`tpupedia.lora`)."""
TEXT_SLOTS = {"qwen": (1000, 3584), "byt5": (256, 1472), "image": (729, 1152)}
"""Tokens and width of each conditioning slot of a step (text-to-video passes a zero image)."""
UPSTREAM_TEXT_TOKENS = 1256
"""Upstream's count of the text beside the video tokens: the Qwen2.5-VL and ByT5 slots, without
the 729 image slots (yangwhale/gpu-tpu-pedia at 3fa9ce1, `tpu/HunyuanVideo-1.5/docs/
dit_implementation_analysis.md`, "Token 数量计算": 111,600 + 1,256 = 112,856 at 720p and 121
frames; also `generate_hunyuan_gpu_staged/README.md`). Upstream's TPU stage 2 passes
`vision_states=None` for text-to-video, so its attention calls had no image slots. diffusers'
transformer, and this course, keep them (zeros, masked) in every joint attention call:
`sequence_tokens` counts them, and the step's FLOPs and floor are of that sequence."""
SPLASH_BLOCK_SIZES = (3072, 2048, 1024)
"""Splash `(block_q, block_kv, block_kv_compute)` for the joint attention: upstream's sizes for
this model (yangwhale/gpu-tpu-pedia at 3fa9ce1,
`tpu/HunyuanVideo-1.5/generate_hunyuan_torchax_staged/stage2_transformer.py`, run there on a TPU
v6e-8 with their own exp2 kernel). JAX's splash kernel at these sizes compiles for v6e within its
VMEM at the release shape (AOT: `tests/test_plan.py` plans the release's denoise step with
them); `--block-sizes` overrides."""

REPORTED_STEPS = (
    dict(resolution="1280x720", frames=121, mesh=(1, 8), sharding="tp_fc2_replicated", step_s=7.29, steps=50,
         source="tpu/HunyuanVideo-1.5/generate_hunyuan_torchax_staged/TORCHAX_MIGRATION_GUIDE.md 6.1.1 "
                "(TP + fc2 replicated, tp8)"),
)
"""Step times reported upstream on a TPU v6e-8 (yangwhale/gpu-tpu-pedia, commit 3fa9ce1), with the
mesh and sharding table the run used (`tpupedia.predict`)."""

SPLASH_PROFILE = dict(
    source="yangwhale/gpu-tpu-pedia, commit 3fa9ce1, tpu/HunyuanVideo-1.5/generate_hunyuan_torchax_staged/"
           "TORCHAX_MIGRATION_GUIDE.md, section 6.1.3 (profiler, one block)",
    chip="v6e", chips=8, seconds=0.035, width=1280, height=720, frames=121, batch=2, heads=16, head_dim=128,
    text_tokens=UPSTREAM_TEXT_TOKENS,
    assumed="the profile is of the guide's 121-frame 720p run, its guidance pair as a batch of 2 (what its stage-2 "
            "script runs), one joint attention call per block over video and text tokens (no image slots: that "
            "script passes no vision states for text-to-video), at the family's splash block sizes",
)
"""Upstream's one splash-kernel report: about 35 ms of one block's time in splash attention on a
v6e-8 (reported upstream, from `stage2_transformer_flax.py`, a script not in the repository at that
commit, size and frames unstated). `assumed` is the shape the kernel model of `tpupedia.predict`
once took it to have; at that shape it would beat the MXU's ceiling for 128-wide heads
(`tpupedia.predict.profile_rate`), so it no longer sets the kernel's rate."""



def full_transformer_config(layers: int | None = None, image_to_video: bool = False) -> dict[str, Any]:
    """The 720p transformer: diffusers' defaults (54 layers, 16 heads of 128, MLP ratio 4,
    Qwen2.5-VL text width 3584, ByT5 width 1472, SigLIP width 1152), target size 960, task `t2v`
    or `i2v` (a label: the model reads no `task_type`; the weights differ, not the shapes)."""
    return dict(num_layers=FULL_LAYERS if layers is None else layers, target_size=TARGET_SIZE,
                task_type="i2v" if image_to_video else "t2v")


BYT5_VOCAB = 1510
"""Rows of the released ByT5 glyph encoder's embedding (`full_text_encoder_configs`)."""


def full_text_encoder_configs() -> dict[str, dict[str, Any]]:
    """The two text encoders of the release, by their public configs: Qwen2.5-VL-7B's text model
    (28 layers, width 3584, 28 query and 4 key-value heads, vocabulary 152,064) and the ByT5-small
    glyph encoder (12 layers, width 1472) with the release's vocabulary of 1510: ByT5's 384 ids
    plus the colour and font tokens of Glyph-SDXL-v2's glyph tokenizer, which diffusers'
    conversion script adds before resizing the embedding to the tokenizer (huggingface/diffusers,
    commit 38c42b4, `scripts/convert_hunyuan_video1_5_to_diffusers.py`, `add_special_token`:
    `tokenizer.add_tokens(...)`, then `text_encoder.resize_token_embeddings(len(tokenizer))`; the
    count comes from Glyph-SDXL-v2's `color_idx.json` and `multilingual_10-lang_idx.json`, and the
    released `text_encoder_2/config.json` says `"vocab_size": 1510`).
    1510 divides neither a `tp` of 4 nor 8, so its embedding is replicated (`tpupedia.sharding.Rule`)."""
    return {"text_encoder": dict(model_type="qwen2_5_vl_text", hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 vocab_size=152064, rms_norm_eps=1e-6, max_position_embeddings=128000,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
            "text_encoder_2": dict(vocab_size=BYT5_VOCAB, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                                   feed_forward_proj="gated-gelu")}


def full_configs(image_to_video: bool = False, step_distilled: bool = False) -> dict[str, dict]:
    """The released checkpoint's component configs, as `component_configs` reads them from a
    download, for planning without one (`tpupedia plan`): transformer, VAE, scheduler and guider
    at diffusers' defaults (the 720p shapes; the scheduler's shift and the guider's scale
    change numbers, not shapes), the text encoders above; `image_to_video`: the 720p i2v
    release's, with its SigLIP image encoder (`full_image_encoder_config`); `step_distilled`: the
    step-distilled 480p i2v release's (`FULL_ID_STEP_DISTILLED`: `STEP_DISTILLED_TRANSFORMER`, its
    shift and guidance scale)."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import Qwen2_5_VLTextConfig, T5Config

    with torch.device("meta"):
        overrides = STEP_DISTILLED_TRANSFORMER if step_distilled else {}
        transformer = dict(HunyuanVideo15Transformer3DModel(**(full_transformer_config(1, image_to_video)
                                                                | overrides)).config)
        vae = dict(AutoencoderKLHunyuanVideo15().config)
    text = full_text_encoder_configs()
    configs = {"transformer": transformer | {"num_layers": FULL_LAYERS}, "vae": vae,
               "scheduler": dict(FlowMatchEulerDiscreteScheduler(**(
                   {"shift": STEP_DISTILLED_SHIFT} if step_distilled else {})).config),
               "guider": dict(ClassifierFreeGuidance(**(
                   {"guidance_scale": STEP_DISTILLED_GUIDANCE} if step_distilled else {})).config),
               "text_encoder": Qwen2_5_VLTextConfig(**text["text_encoder"]).to_dict(),
               "text_encoder_2": T5Config(**text["text_encoder_2"]).to_dict()}
    if image_to_video:
        from transformers import SiglipVisionConfig

        configs["image_encoder"] = SiglipVisionConfig(**full_image_encoder_config()).to_dict()
        configs["pipeline"] = {"feature_extractor": ["transformers", "SiglipImageProcessor"]}
    return configs


def full_image_encoder_config() -> dict[str, Any]:
    """The i2v release's image encoder: SigLIP so400m/14 at 384 px (diffusers' conversion script
    takes FLUX.1-Redux-dev's `image_encoder`): 27 layers of width 1152, 16 heads, patches of 14, so
    27 x 27 = 729 tokens, the transformer's image slot."""
    return dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=384, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


def image_to_video(configs: dict[str, dict]) -> bool:
    """Whether a checkpoint (its component configs) generates from a picture: its
    `model_index.json` names an image encoder (SigLIP). Not the transformer: text-to-video and
    image-to-video checkpoints have the same 65 input channels (the latents, the condition
    latents, zeros for text-to-video, and the mask), and its `task_type` is a label the model
    never reads (diffusers' conversion script writes `i2v` into the 480p t2v config)."""
    return "image_encoder" in configs


def image_tokens(configs: dict[str, dict]) -> int:
    """Tokens of the image slot of a step: the image encoder's patches ((384 // 14)^2 = 729 for
    SigLIP so400m/14), or for a text-to-video checkpoint the 729 zeros its pipeline passes."""
    encoder = configs.get("image_encoder")
    if encoder is None:
        return TEXT_SLOTS["image"][0]
    return (encoder["image_size"] // encoder["patch_size"]) ** 2


def image_condition(image_latents, latent_frames: int):
    """What image-to-video puts beside the noisy latents on channels, `(1, C + 1, T, h, w)`: the
    picture's latents `(1, C, 1, h, w)` as the first of `latent_frames` frames (zeros after it),
    then a mask of ones on that frame and zeros elsewhere (stock `prepare_cond_latents_and_mask`).
    Text-to-video puts zeros in both."""
    import torch

    _, channels, _, h, w = image_latents.shape
    latents = image_latents.new_zeros(1, channels, latent_frames, h, w)
    latents[:, :, :1] = image_latents
    mask = image_latents.new_zeros(1, 1, latent_frames, h, w)
    mask[:, :, 0] = 1.0
    return torch.cat([latents, mask], dim=1)


def slot_tokens(configs: dict[str, dict]) -> int:
    """Conditioning tokens of a step, padding included: the Qwen2.5-VL and ByT5 slots and the image
    slot (`image_tokens`)."""
    return TEXT_SLOTS["qwen"][0] + TEXT_SLOTS["byt5"][0] + image_tokens(configs)


def video_size(picture_width: int, picture_height: int, configs: dict[str, dict]) -> tuple[int, int]:
    """`(width, height)` of the video image-to-video makes from a `picture_width` x
    `picture_height` picture, as `HunyuanVideo15ImageToVideoPipeline` picks it: the bucket, around
    the transformer's `target_size` squared in pixels (multiples of the VAE's spatial compression),
    whose aspect is nearest the picture's on the side of its longer edge. The picture is then
    resized and centre-cropped to it (`width` and `height` are not the caller's to choose)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=shape_facts(configs).spatial)
    target = configs["transformer"].get("target_size", 640)
    height, width = processor.calculate_default_height_width(picture_height, picture_width, target)
    return int(width), int(height)


def tiny_transformer_config() -> dict[str, Any]:
    """2 blocks, 2 heads of 8, patch 1 (its 2048-wide glyph projection is hard-coded upstream)."""
    return dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")


def tiny_image_encoder_config() -> dict[str, Any]:
    """A 2-layer SigLIP vision tower as wide as the tiny transformer's image slot (12), patches of 8
    over 32 px: 16 tokens; SigLIP so400m's structure at CPU size."""
    return dict(hidden_size=12, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


def tiny_image_processor():
    """The release's SigLIP preprocessing (resized to a square, bicubic; mean and std 0.5) at the
    tiny tower's 32 px: `SiglipImageProcessorPil`, the PIL backend of the `SiglipImageProcessor`
    the release names (whose default backend needs torchvision)."""
    from transformers import SiglipImageProcessorPil

    side = tiny_image_encoder_config()["image_size"]
    return SiglipImageProcessorPil(size={"height": side, "width": side})


TINY_TARGET_SIZE = 64
"""The tiny image-to-video transformer's `target_size`: buckets of 16 latent pixels (64 x 64 for a
square picture), seconds on a CPU."""


def tiny_vae_config() -> dict[str, Any]:
    """A 5-level `AutoencoderKLHunyuanVideo15`, 8 channels wide (113,761 parameters), with the full
    VAE's compression (16x spatial, 4x temporal), so the tiny preset has the full frame and size rules."""
    return dict(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                spatial_compression_ratio=SPATIAL_COMPRESSION, temporal_compression_ratio=TEMPORAL_COMPRESSION,
                downsample_match_channel=False, upsample_match_channel=False)


def tiny_text_encoder_configs() -> dict[str, dict[str, Any]]:
    """`text_encoder`: a Qwen2.5-VL text model 16 wide over the tiny tokenizer's 259 tokens, its
    embedding padded to 264 rows as the released model pads 151,665 tokens to 152,064 (so the
    vocabulary-parallel embedding divides a `tp` axis of 8); `text_encoder_2`: a 2-layer T5
    encoder 32 wide over ByT5's 384 bytes."""
    qwen = dict(vocab_size=264, hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=2, use_cache=False, rope_theta=1e6, bos_token_id=0, eos_token_id=258,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
    t5 = dict(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return {"text_encoder": qwen, "text_encoder_2": t5}


# The Qwen2.5-VL chat layout (system / user / assistant turns between <|im_start|> and <|im_end|>),
# written here as a minimal template: the full checkpoint ships its own.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen_tokenizer():
    """An offline byte-level Qwen2 tokenizer (259 tokens) with Qwen2.5-VL's special tokens:
    `<|endoftext|>` pads, `<|im_end|>` ends, no BOS, right padding, and a chat template."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(ByteLevel.alphabet()))}}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>", eos_token="<|im_end|>",
                         bos_token=None, padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def default_request(preset: Any) -> dict[str, Any]:
    """Frames, size, steps, seed and fps a preset generates by default: the tiny preset seconds on
    a CPU; the full preset the 720p checkpoint's 121 frames, 50 steps at 24 fps. Guidance and shift
    come from the checkpoint (its guider and scheduler configs), as diffusers takes them."""
    if preset.pretrained:
        return dict(frames=121, height=720, width=1280, steps=50, seed=42, fps=24)
    return dict(frames=9, height=64, width=64, steps=4, seed=42, fps=8)


def shape_facts(configs: dict[str, dict]) -> ShapeFacts:
    """A checkpoint's shape facts from its component configs, as `HunyuanVideo15Pipeline` reads
    them: the VAE's `spatial_compression_ratio`, `temporal_compression_ratio` and `latent_channels`,
    the transformer's `patch_size` and `patch_size_t`."""
    vae, transformer = configs["vae"], configs["transformer"]
    return ShapeFacts(spatial=int(vae["spatial_compression_ratio"]), temporal=int(vae["temporal_compression_ratio"]),
                      patch=int(transformer["patch_size"]), patch_t=transformer.get("patch_size_t"),
                      latent_channels=int(vae["latent_channels"]))


def check_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a frame count the VAE cannot produce: it must be temporal * n + 1 (4n+1 for the released VAE)."""
    if not facts.frames_ok(frames):
        t = facts.temporal
        rounded = facts.frames_for(facts.latent_frames(max(1, frames))) if isinstance(frames, int) else "?"
        raise ModelInputError(
            f"frames={frames}: HunyuanVideo-1.5 generates {t}n+1 frames (the VAE keeps the first frame and "
            f"compresses the rest {t}x in time), e.g. {t * 2 + 1}, {t * 12 + 1}, {t * 30 + 1}; diffusers would round "
            f"{frames} down to {rounded} silently")


def check_size(width: int, height: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a size the VAE cannot tile: positive multiples of spatial * patch (16)."""
    if not facts.size_ok(width, height):
        raise ModelInputError(f"size {width}x{height}: width and height must be positive multiples of "
                              f"{facts.size_multiple} (the VAE compresses {facts.spatial}x, patches of {facts.patch})")


def latent_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> int:
    """Latent frames for `frames` (4n+1) video frames."""
    return facts.latent_frames(frames)


def latent_shape(frames: int, height: int, width: int, facts: ShapeFacts = DEFAULT_SHAPES) -> tuple[int, ...]:
    """`(1, C, T, H/16, W/16)`, the latents diffusers draws (`prepare_latents`)."""
    return (1, facts.latent_channels, facts.latent_frames(frames), *facts.latent_size(height, width))


def video_tokens(width: int, height: int, frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> int:
    """Video tokens of one sample (patch size 1: one per latent pixel)."""
    per = facts.size_multiple
    return facts.latent_frames(frames) // (facts.patch_t or 1) * (height // per) * (width // per)


def sequence_tokens(width: int, height: int, frames: int) -> int:
    """Tokens of one sample's joint attention call at full size: the video tokens and every
    conditioning slot (`TEXT_SLOTS`: Qwen2.5-VL, ByT5 and the 729 image slots, which diffusers
    keeps, as zeros, for text-to-video too). `kept_text_tokens` keeps all the slots at full size,
    so this is the sequence the splash kernel runs: 113,585 at 720p and 121 frames (upstream
    counts 112,856 without the image slots: `UPSTREAM_TEXT_TOKENS`)."""
    return video_tokens(width, height, frames) + sum(n for n, _ in TEXT_SLOTS.values())


def attention_call(width: int, height: int, frames: int, configs: dict[str, dict]) -> tuple[int, int]:
    """`(heads, tokens)` of one sample's joint attention in the transformer of `configs`: its
    heads, and the video tokens of the request (the checkpoint's shape facts) with every
    conditioning slot (`TEXT_SLOTS`, as `sequence_tokens`; `tpupedia.plan.gpu_attention` sizes the
    reference attention's scores from it)."""
    tokens = video_tokens(width, height, frames, shape_facts(configs)) + sum(n for n, _ in TEXT_SLOTS.values())
    return int(configs["transformer"]["num_attention_heads"]), tokens


def mask_elements(width: int, height: int, frames: int) -> int:
    """Elements of the (1, 1, S, S) mask diffusers builds per sample, S = video + all text slots."""
    s = sequence_tokens(width, height, frames)
    return s * s


def step_flops(width: int, height: int, frames: int, layers: int = FULL_LAYERS, batch: int = 2,
               heads: int = 16, head_dim: int = 128, text_tokens: int | None = None,
               mlp_ratio: float = 4.0) -> dict[str, float]:
    """Matmul FLOPs of one step: dual-stream blocks, so every token (video and text) goes through
    q, k, v, out (4 d^2) and the MLP (2 * mlp_ratio * d^2) once per layer. The text is every
    conditioning slot (`sequence_tokens`) unless `text_tokens` says otherwise."""
    d = heads * head_dim
    if text_tokens is None:
        text_tokens = sum(n for n, _ in TEXT_SLOTS.values())
    s = latent_frames(frames) * (height // SPATIAL_COMPRESSION) * (width // SPATIAL_COMPRESSION) + text_tokens
    linear = batch * layers * 2 * s * (4 + 2 * mlp_ratio) * d * d
    attention = batch * layers * 4 * s * s * d
    return {"tokens": s, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def build(layers: int | None = None, device: str = "meta", dtype: Any = None):
    """The full transformer (shapes only on `meta`), bf16 by default."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device(device):
        return HunyuanVideo15Transformer3DModel(**full_transformer_config(layers)).to(dtype or torch.bfloat16)


def step_inputs(width: int, height: int, frames: int, batch: int = 2) -> tuple[list, Any]:
    """`(input specs, call)` for the dry-run: latents with the transformer's 65 input channels
    (32 latent + 32 condition + 1 mask), the timestep and the three conditioning slots, batch on `dp`."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    (qwen, qwen_w), (byt5, byt5_w), (image, image_w) = TEXT_SLOTS.values()
    t = latent_frames(frames)
    specs = [
        ((batch, 65, t, height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION), jnp.bfloat16, P("dp")),
        ((batch,), jnp.int32, P("dp")),
        ((batch, qwen, qwen_w), jnp.bfloat16, P("dp")),
        ((batch, qwen), jnp.int32, P("dp")),
        ((batch, byt5, byt5_w), jnp.bfloat16, P("dp")),
        ((batch, byt5), jnp.int32, P("dp")),
        ((batch, image, image_w), jnp.bfloat16, P("dp")),
    ]

    def call(fm, w, b, x, ts, text, mask, text2, mask2, img):
        return fm(w, b, x, ts, text, mask, encoder_hidden_states_2=text2, encoder_attention_mask_2=mask2,
                  image_embeds=img, return_dict=False)[0]

    return specs, call


# --- the forward: jit-friendly, split where DeepCache cuts it --------------------------------------

def conditioning(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, timestep_r=None,
                 encoder_hidden_states_2=None, encoder_attention_mask_2=None, image_embeds=None, text_tokens=None):
    """Everything before the first block: `(video tokens, text tokens, text mask, temb, rope)`.
    The text tokens are ordered valid-first (image, ByT5, Qwen), the padding zeroed, as diffusers
    orders them, but with a stable argsort instead of boolean indexing. With `text_tokens`, only
    the first `text_tokens` of them go on (`kept_text_tokens`)."""
    import torch

    image_rotary_emb = self.rope(hidden_states)
    temb = self.time_embed(timestep, timestep_r=timestep_r)
    hidden_states = self.x_embedder(hidden_states)

    text = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
    text = text + self.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
    text_2 = self.context_embedder_2(encoder_hidden_states_2)
    text_2 = text_2 + self.cond_type_embed(torch.ones_like(text_2[:, :, 0], dtype=torch.long))
    image = self.image_embedder(image_embeds)
    is_t2v = torch.all(image_embeds == 0)
    image = torch.where(is_t2v, image * 0.0, image)  # was a Python `if is_t2v:`
    image = image + self.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
    mask_1, mask_2 = encoder_attention_mask.bool(), encoder_attention_mask_2.bool()
    tokens = torch.cat([image, text_2 * mask_2[..., None], text * mask_1[..., None]], dim=1)
    order, mask = _token_order(encoder_attention_mask, encoder_attention_mask_2, image_embeds, text_tokens)
    text = torch.gather(tokens, 1, order[..., None].expand(*order.shape, tokens.shape[-1]))
    return hidden_states, text, mask, temb, image_rotary_emb


KEEP_ALL_TEXT_BELOW = 0.05
"""`kept_text_tokens` keeps every text slot when the slots are less than this share of the
sequence: cutting them would save at most that share of a step, and each rounded length is a
new compile of the whole step (a minute or more for 54 layers on a TPU)."""


def kept_text_tokens(valid_counts, slots: int, multiple: int = 128, video_tokens: int | None = None) -> int:
    """How many of a step's `slots` text tokens (image, ByT5 and Qwen slots together) to keep
    once they are ordered valid-first: the most valid tokens of any sample in the batch
    (`valid_counts`, read on the host from the text stage's masks), rounded up to `multiple`.

    The tokens cut are padding: every query masks them out, and the output reads only video
    tokens, so the video is unchanged (up to the order of a softmax's sum). At full size the
    text is a small part of the sequence (1,985 slots beside 111,600 video tokens at 720p and 121
    frames), so the saving is small there; on the tiny model, where text dominates the
    sequence, it is most of the step. One compiled step serves every prompt of the same rounded
    length. Given the step's `video_tokens`, every slot is kept when the slots are under
    `KEEP_ALL_TEXT_BELOW` of the sequence: one compiled step for every prompt, the one `tpupedia
    plan` compiles (all the slots, the most any prompt needs)."""
    if video_tokens is not None and slots < KEEP_ALL_TEXT_BELOW * (slots + video_tokens):
        return slots
    most = int(max(valid_counts))
    return min(slots, max(multiple, -(-most // multiple) * multiple))


def _token_order(encoder_attention_mask, encoder_attention_mask_2, image_embeds, text_tokens=None):
    """`(order, mask)`: the permutation that puts valid text tokens first, order kept, and the
    mask in that order (what diffusers' boolean-indexing reorder computes); the first
    `text_tokens` of each when given."""
    import torch

    is_t2v = torch.all(image_embeds == 0)
    image_mask = (~is_t2v).expand(image_embeds.shape[0], image_embeds.shape[1])
    valid = torch.cat([image_mask, encoder_attention_mask_2.bool(), encoder_attention_mask.bool()], dim=1)
    order = torch.argsort((~valid).to(torch.int32), dim=1, stable=True)[:, :text_tokens]  # valid first, order kept
    return order, torch.gather(valid, 1, order)


def blocks(self, hidden_states, text, mask, temb, rope, start: int = 0, stop: int | None = None):
    """Dual-stream blocks `start:stop` on `(video tokens, text tokens)`."""
    for block in self.transformer_blocks[start:stop]:
        hidden_states, text = block(hidden_states, text, temb, mask, rope)
    return hidden_states, text


def final(self, hidden_states, temb, shape):
    """Norm, projection and un-patchify to the latents' `shape` (B, C, T, H, W)."""
    batch_size, _, num_frames, height, width = shape
    p_t, p_h, p_w = self.config.patch_size_t, self.config.patch_size, self.config.patch_size
    hidden_states = self.proj_out(self.norm_out(hidden_states, temb))
    hidden_states = hidden_states.reshape(batch_size, num_frames // p_t, height // p_h, width // p_w, -1, p_t, p_h, p_w)
    return hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def static_forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                   timestep_r=None, encoder_hidden_states_2=None, encoder_attention_mask_2=None,
                   image_embeds=None, attention_kwargs=None, return_dict=True, text_tokens=None):  # noqa: ARG001 - the stock signature
    """`HunyuanVideo15Transformer3DModel.forward` without its two untraceable constructs (see the
    module docstring); the same signature and outputs, plus `text_tokens` (`kept_text_tokens`)."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    shape = hidden_states.shape
    x, text, mask, temb, rope = conditioning(self, hidden_states, timestep, encoder_hidden_states,
                                             encoder_attention_mask, timestep_r, encoder_hidden_states_2,
                                             encoder_attention_mask_2, image_embeds, text_tokens)
    x, _ = blocks(self, x, text, mask, temb, rope)
    out = final(self, x, temb, shape)
    return (out,) if not return_dict else Transformer2DModelOutput(sample=out)


def make_static(module):
    """Replace `module.forward` with `static_forward`. Returns `module`."""
    module.forward = types.MethodType(static_forward, module)
    return module


def deepcache_full(self, tail: int, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                   encoder_hidden_states_2, encoder_attention_mask_2, image_embeds, text_tokens=None):
    """`(output, cache)`: the full forward, and the `(video, text)` tokens entering the last
    `tail` blocks, which a cached step starts from."""
    shape = hidden_states.shape
    x, text, mask, temb, rope = conditioning(self, hidden_states, timestep, encoder_hidden_states,
                                             encoder_attention_mask, None, encoder_hidden_states_2,
                                             encoder_attention_mask_2, image_embeds, text_tokens)
    cut = len(self.transformer_blocks) - tail
    x, text = blocks(self, x, text, mask, temb, rope, 0, cut)
    cache = (x, text)
    x, _ = blocks(self, x, text, mask, temb, rope, cut)
    return final(self, x, temb, shape), cache


def deepcache_cached(self, tail: int, cache, hidden_states, timestep, encoder_attention_mask,
                     encoder_attention_mask_2, image_embeds, text_tokens=None):
    """The output from a cached state: the timestep embedding and RoPE of this step, the last
    `tail` blocks, the final layer. The text refiner and the first blocks do not run."""
    x, text = cache
    _, mask = _token_order(encoder_attention_mask, encoder_attention_mask_2, image_embeds, text_tokens)
    temb = self.time_embed(timestep, timestep_r=None)
    rope = self.rope(hidden_states)
    x, _ = blocks(self, x, text, mask, temb, rope, len(self.transformer_blocks) - tail)
    return final(self, x, temb, hidden_states.shape)


# --- attention with the padding kept as a vector ----------------------------------------------------

def torch_padded_attention(q, k, v, valid):
    """`(B, H, S, D)` attention where token j is visible to token i iff both are valid, as
    diffusers computes it (the (B, 1, S, S) mask built from the vector); for torch tensors."""
    import torch.nn.functional as F

    mask = valid[:, None, None, :] & valid[:, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)


class PaddingAttnProcessor:
    """diffusers' `HunyuanVideo15AttnProcessor2_0` (0.42.1) with the padding mask kept as a
    `(B, S)` vector and handed to `attend(q, k, v, valid)` (`(B, H, S, D)` tensors), instead of
    being expanded to `(B, 1, S, S)`. The projections, QK norms and RoPE are the stock ones."""

    def __init__(self, attend=None):
        self.attend = attend or torch_padded_attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        import torch
        import torch.nn.functional as F
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(t):
            return t.unflatten(2, (attn.heads, -1))

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if encoder_hidden_states is not None:
            eq = heads(attn.add_q_proj(encoder_hidden_states))
            ek = heads(attn.add_k_proj(encoder_hidden_states))
            ev = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = torch.cat([query, eq], 1), torch.cat([key, ek], 1), torch.cat([value, ev], 1)
        seq_len = query.shape[1]
        valid = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
        out = self.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), valid)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        n_text = encoder_hidden_states.shape[1]
        out, text = out[:, :-n_text], out[:, -n_text:]
        out = attn.to_out[1](attn.to_out[0](out))
        return out, attn.to_add_out(text)


def make_jit_friendly(transformer, attend=None):
    """`make_static` plus `PaddingAttnProcessor(attend)` in the dual-stream blocks (the token
    refiner keeps its processor: its 1000-token mask is small). Returns `transformer`."""
    make_static(transformer)
    processor = PaddingAttnProcessor(attend)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(processor)
    return transformer


# --- the VAE's mid-block attention mask, without a loop per token ----------------------------------

def padded_forward(transformer, attend):
    """Make `transformer` jit-friendly with the padding handed to `attend` as a vector
    (`make_jit_friendly`) and return the forward to compile (`static_forward`): what the pipeline
    runs and `tpupedia dryrun` compiles with `--mask vector`."""
    make_jit_friendly(transformer, attend)
    return static_forward


def vae_attention_mask(n_frame: int, n_hw: int, dtype: Any, device: Any, batch_size: int | None = None):
    """The frame-causal mask of the VAE's mid-block attention: token i (of frame i // n_hw) sees
    every token of its own and earlier frames (0) and none of later frames (-inf); `(S, S)` or
    `(batch_size, 1, S, S)` with S = n_frame * n_hw.

    The same values as diffusers' `HunyuanVideo15AttnBlock.prepare_causal_attention_mask`
    (0.42.1), which fills the mask row by row in a Python loop. Traced for a TPU, that loop
    becomes one scatter per latent token (7,936 for a 16x16 tile of 31 latent frames; 111,600 for
    720p untiled) and the compile runs for many minutes or overflows the compiler's stack; here it
    is one comparison of two frame indices. diffusers returns `(batch_size, S, S)`, which the
    attention's `(batch_size, 1, S, S)` scores broadcast to `(batch_size, batch_size, S, S)`: a
    batch of more than one latent fails to reshape (diffusers' VAE decodes one sample at a time).
    The head axis here makes a batch decode each sample as alone, which decoding tiles side by
    side (`tpupedia.pipelines.decoding.in_waves`) relies on.
    """
    import torch

    frame = torch.arange(n_frame * n_hw, device=device) // n_hw
    mask = torch.full((frame.shape[0], frame.shape[0]), float("-inf"), dtype=dtype, device=device)
    mask = mask.masked_fill(frame[None, :] <= frame[:, None], 0)
    return mask if batch_size is None else mask[None, None].expand(batch_size, 1, -1, -1)


def make_vae_jit_friendly(vae):
    """Give every mid-block attention of a diffusers `AutoencoderKLHunyuanVideo15` the loop-free
    `vae_attention_mask` (the same values). Returns `vae`."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    for module in vae.modules():
        if isinstance(module, HunyuanVideo15AttnBlock):
            module.prepare_causal_attention_mask = vae_attention_mask  # an instance attribute: no `self`
    return vae


# Sharding tables for the transformer (diffusers `HunyuanVideo15Transformer3DModel` names; notebook
# 09 compares them). `tp_fc2_replicated` is upstream's default: the row-parallel layers replicated.
_COL = (
    r"(attn\.to_q|attn\.to_k|attn\.to_v|attn\.add_q_proj|attn\.add_k_proj|attn\.add_v_proj"
    r"|ff\.net\.0\.proj|ff_context\.net\.0\.proj)"
)
_ROW_ATTN = r"(attn\.to_out\.0|attn\.to_add_out)"
_ROW_MLP = r"(ff\.net\.2|ff_context\.net\.2)"
QUANTIZE_KEEP: tuple[tuple[str, str], ...] = (
    (r"(image_embedder|context_embedder|context_embedder_2|time_embed)\..*",
     "the image, text and timestep embedders and the text's token refiner: the conditioning every block reads"),
    (r"transformer_blocks\.\d+\.norm1(_context)?\.linear", "adaLN modulation: its output scales and shifts every token of the block's input, so its error moves a whole activation, not one output channel's share"),
    (r"norm_out\.linear|proj_out", "the last modulation and the projection to latents: their errors are the prediction's"),
)
"""The transformer's linears `--quantize` keeps in the checkpoint's dtype (`tpupedia.quantize`), each
regex with its reason; every other linear is quantized. A starting table from where errors spread,
not from frames measured on real weights (none were measured here)."""

SHARDING: dict[str, list] = {
    "tp": [
        (rf".*\.{_COL}\.weight", ("tp", None)),
        (rf".*\.{_COL}\.bias", ("tp",)),
        (rf".*\.({_ROW_ATTN[1:-1]}|{_ROW_MLP[1:-1]})\.weight", (None, "tp")),
        (r"context_embedder_2\.linear_1\.weight", ("tp", None)),
        (r"context_embedder_2\.linear_1\.bias", ("tp",)),
        (r"context_embedder_2\.linear_2\.weight", (None, "tp")),
    ],
    "tp_fc2_replicated": [
        (rf".*\.{_COL}\.weight", ("tp", None)),
        (rf".*\.{_COL}\.bias", ("tp",)),
        (rf".*\.({_ROW_ATTN[1:-1]}|{_ROW_MLP[1:-1]})\.weight", ()),
        (r"context_embedder_2\.linear_1\.weight", ("tp", None)),
        (r"context_embedder_2\.linear_1\.bias", ("tp",)),
        (r"context_embedder_2\.linear_2\.weight", ()),
    ],
    "fsdp": [
        (rf".*\.({_COL[1:-1]}|{_ROW_ATTN[1:-1]}|{_ROW_MLP[1:-1]})\.weight", ("fsdp", None)),
        (r"context_embedder_2\.linear_[12]\.weight", ("fsdp", None)),
    ],
    "replicated": [],
}

def _floor_720p(step_s: float | None = None) -> float:
    """The 720p, 121-frame step's FLOPs (`step_flops`, over `sequence_tokens`) at the bf16 peak of a
    v6e-8: seconds, or with `step_s` the share of that peak a step of `step_s` seconds runs at."""
    from tpupedia import hardware

    peak = 8 * hardware.chip("v6e").bf16_flops
    total = step_flops(1280, 720, 121)["total"]
    return total / peak if step_s is None else total / (step_s * peak)


_SEQUENCE_FIGURES = (
    # The sequence the splash kernel runs at 720p and 121 frames, and what follows from it. Upstream's
    # 112,856 leaves the image slots out (`UPSTREAM_TEXT_TOKENS`); a page that quotes it says so
    # (tests/test_figures.py).
    QuotedFigure("hunyuan.720p_121f.tokens", "computed", match={}, decimals=0,
                 compute=lambda: sequence_tokens(1280, 720, 121), text=lambda v: f"{v:,.0f}",
                 source="tpupedia.models.hunyuan.sequence_tokens: 111,600 video tokens + the Qwen2.5-VL, ByT5 "
                        "and image slots",
                 quotes=(("docs/**/*.md", r"(\d{3},\d{3})\^2 = 12\.9 G"),
                         ("docs/**/*.md", r"(\d{3},\d{3}) (?:tokens|个 token)\s+[x×]\s+2,048"),
                         ("docs/**/*.md", r"HunyuanVideo-1\.5 (?:has|有) (\d{3},\d{3})"),
                         ("docs/**/*.md", r"joint sequence[^.]{0,40}?(\d{3},\d{3}) tokens"),
                         ("docs/**/*.md", r"联合序列[^。]{0,40}?(\d{3},\d{3}) 个 token"),
                         ("lessons/*.py", r"mask over (\d{3},\d{3})"))),
    QuotedFigure("hunyuan.720p_121f.step_flops", "computed", match={}, decimals=2,
                 compute=lambda: step_flops(1280, 720, 121)["total"], text=lambda v: f"{v / 1e16:.2f}e16",
                 source="tpupedia.models.hunyuan.step_flops(1280, 720, 121): matmul FLOPs of a step, batch 2, "
                        "over that sequence",
                 quotes=(("docs/**/*.md", r"compiled step does (\d\.\d\de16) FLOPs"),
                         ("docs/**/*.md", r"编译后的单步要做 (\d\.\d\de16) FLOPs"))),
    QuotedFigure("hunyuan.720p_121f.floor_s", "computed", match={}, decimals=2, compute=_floor_720p,
                 source="tpupedia.models.hunyuan.step_flops(1280, 720, 121) over 8 v6e chips at the bf16 peak "
                        "(tpupedia.hardware)",
                 quotes=(("docs/**/*.md", r"at least (\d\.\d\d) s on a v6e-8"),
                         ("docs/**/*.md", r"至少需要 (\d\.\d\d) 秒"),
                         ("docs/**/*.md", r"HunyuanVideo-1\.5 720p[^\n]*\(`tp=8`\) \| (\d\.\d\d) s \|"),
                         ("docs/**/*.md", r"HunyuanVideo-1\.5 720p[^\n]*（`tp=8`） \| (\d\.\d\d) 秒 \|"))),
    QuotedFigure("hunyuan.720p_121f.mfu_tp_fc2", "computed", match={}, decimals=0,
                 compute=lambda: _floor_720p(REPORTED_STEPS[0]["step_s"]), text=lambda v: f"{v:.0%}",
                 source="tpupedia.models.hunyuan.step_flops(1280, 720, 121) over upstream's TP + fc2 replicated "
                        "step (REPORTED_STEPS) on 8 v6e chips at the bf16 peak",
                 quotes=(("docs/**/*.md", r"7\.29 \((\d+%) of peak\)"),
                         ("docs/**/*.md", r"7\.29（峰值的 (\d+%)）"))),
)

_STEP_SOURCES = (
    "steps: tencent/HunyuanVideo-1.5's README (news of Dec 05, 2025) and assets/step_distillation_comparison.md: "
    "\"8 or 12 steps: recommended default setting\" (the comparisons are at 8), \"4 steps: faster generation with "
    "slightly reduced quality\"",
    "guidance 1.0 (off) and shift 7.0: diffusers' conversion script for 480p_i2v_step_distilled (huggingface/diffusers "
    "PR #12802, GUIDANCE_CONFIGS and SCHEDULER_CONFIGS), what the checkpoint's guider and scheduler configs hold",
)
STEP_DISTILLED = FewStepRelease(
    name="step-distilled", title="HunyuanVideo-1.5 480p image-to-video, step-distilled: 8 steps, guidance off",
    model=FULL_ID_STEP_DISTILLED, steps=8, guidance=STEP_DISTILLED_GUIDANCE, fields={"shift": STEP_DISTILLED_SHIFT},
    image_to_video=True, sources=_STEP_SOURCES)
STEP_DISTILLED_FAST = FewStepRelease(
    name="step-distilled-4", title="HunyuanVideo-1.5 480p image-to-video, step-distilled at its fastest: 4 steps",
    model=FULL_ID_STEP_DISTILLED, steps=4, guidance=STEP_DISTILLED_GUIDANCE, fields={"shift": STEP_DISTILLED_SHIFT},
    image_to_video=True, sources=_STEP_SOURCES)
FEW_STEP = {r.name: r for r in (STEP_DISTILLED, STEP_DISTILLED_FAST)}
"""The family's step-distilled releases by name (`FamilySpec.few_step`, `--release NAME`)."""

SPEC = FamilySpec(
    name=FAMILY, module=__name__, full_id=FULL_ID, sharding=SHARDING, mask="padding",
    dryrun_masks=("vector", "matrix"),
    title="HunyuanVideo-1.5 (720p t2v on the full preset): Qwen2.5-VL + ByT5 -> transformer -> VAE",
    releases={FULL_ID: {}, FULL_ID_I2V: {"image_to_video": True},
              FULL_ID_STEP_DISTILLED: {"image_to_video": True, "step_distilled": True}},
    few_step=FEW_STEP,
    figures=(
        QuotedFigure("upstream.hunyuan.step_s.tp_fc2", "upstream_step",
                     match={"name": "HunyuanVideo-1.5 720p t2v, TP + fc2 replicated"}, decimals=2,
                     source="docs/results/upstream.json (reported upstream, TPU v6e-8)",
                     quotes=(("docs/**/*.md", r"(\d\.\d\d) s/step with the library splash kernel"),
                             ("docs/**/*.md", r"TP \+ fc2 replicated: (\d\.\d\d) s/step"),
                             ("lessons/*.py", r"reports the same direction on a v6e-8: (\d\.\d\d) s/step"))),
        QuotedFigure("upstream.hunyuan.step_s.exp2", "upstream_step",
                     match={"name": "HunyuanVideo-1.5 720p t2v, custom exp2 splash"}, decimals=2,
                     source="docs/results/upstream.json (reported upstream, TPU v6e-8)",
                     quotes=(("docs/**/*.md", r"(\d\.\d\d) s/step with the custom exp2 kernel"),)),
        QuotedFigure("plan.hunyuan.decode_gib", "plan_peak", stage="decode", decimals=2,
                     match={"family": FAMILY, "topology": "v6e:2x4", "layers": None, "vae_tiling": True,
                            "stages": ("decode",)},
                     source="docs/results/plans.json: tpupedia plan hunyuan --stages decode --vae-tiling on "
                            "(AOT here, 4 chips)"),
        QuotedFigure("plan.hunyuan.decode_untiled_gib", "plan_oom", decimals=0,
                     match={"family": FAMILY, "topology": "v6e:2x4", "layers": None, "vae_tiling": False,
                            "stages": ("decode",)},
                     source="docs/results/plans.json: tpupedia plan hunyuan --stages decode --vae-tiling off "
                            "(AOT here, does not fit)"),
        *_SEQUENCE_FIGURES,
        QuotedFigure("plan.hunyuan.v5e1.bf16_720p.weights_gib", "plan_weights", stage="denoise", decimals=2,
                     match={"family": FAMILY, "topology": "v5e:1x1", "stages": ("text", "denoise"),
                            "request": lambda q: (q.get("quantize"), q["width"], q["frames"]) == (None, 1280, 121)},
                     source="docs/results/plans.json: tpupedia plan hunyuan --topology v5e:1x1 (AOT here, one layer "
                            "compiled)"),
        *(QuotedFigure(f"plan.hunyuan.v5e1.int8_{name}.{what}", read, stage=None if what == "predicted" else "denoise",
                       decimals=2, text=(lambda v: f"{v / 60:.1f} min") if what == "predicted" else None,
                       match={"family": FAMILY, "topology": "v5e:1x1", "stages": ("text", "denoise"),
                              "request": lambda q, w=w, f=f: (q.get("quantize"), q["width"], q["frames"]) == ("int8", w, f)},
                       source=f"docs/results/plans.json: tpupedia plan hunyuan --topology v5e:1x1 --quantize int8 "
                              f"(AOT here, one layer compiled, {w} wide, {f} frames)")
          for name, w, f in (("720p", 1280, 121), ("480p_121f", 848, 121), ("480p_61f", 848, 61))
          for what, read in (("denoise_gib", "plan_peak"), ("weights_gib", "plan_weights"),
                             ("predicted", "plan_predicted"))),
    ),
)
"""This family in the registry (`tpupedia.families`)."""


# --- weights: tiny checkpoints and loading -------------------------------------------------------

SCHEDULER_CONFIG: dict[str, Any] = dict(shift=7.0)
"""The tiny preset's `FlowMatchEulerDiscreteScheduler` (diffusers' default flow-matching scheduler
with HunyuanVideo-1.5's training shift); a full checkpoint brings its own."""
GUIDER_CONFIG: dict[str, Any] = dict(guidance_scale=6.0)
"""The tiny preset's `ClassifierFreeGuidance` (guidance on, so CI runs the guidance pair)."""


def tiny_checkpoint(directory: "str | os.PathLike | None" = None, seed: int = 0, vae: dict | None = None,
                    transformer: dict | None = None, image_to_video: bool = False,
                    text_encoders: dict[str, dict] | None = None) -> Path:
    """Write a whole random `HunyuanVideo15Pipeline` (Qwen2.5-VL text model with the offline
    tokenizer in Qwen's file layout, `tokenizer_files.write_qwen_bpe`, T5 + ByT5 for glyphs, transformer, VAE, scheduler, guider) with `save_pretrained`
    and return its directory (cached, named by its configs, written atomically). `vae` and
    `transformer` override config entries (a checkpoint with other shape facts, for the tests).
    `image_to_video` writes a `HunyuanVideo15ImageToVideoPipeline` in the i2v releases' layout:
    a SigLIP image encoder and its `SiglipImageProcessorPil`, target size `TINY_TARGET_SIZE`
    (`transformer={"use_meanflow": True}` gives the step-distilled 480p release's second
    timestep embedding). `text_encoders` overrides entries of `tiny_text_encoder_configs` by
    encoder, e.g. `{"text_encoder_2": {"vocab_size": BYT5_VOCAB}}` (the release's glyph vocabulary)
    or `{"text_encoder": {"vocab_size": 259}}` (an embedding resized to the tokenizer)."""
    transformer_config = tiny_transformer_config() | (
        {"target_size": TINY_TARGET_SIZE, "task_type": "i2v"} if image_to_video else {}) | (transformer or {})
    vae_config = tiny_vae_config() | (vae or {})
    text_configs = {name: config | (text_encoders or {}).get(name, {})
                    for name, config in tiny_text_encoder_configs().items()}
    spec = [transformer_config, vae_config, text_configs, SCHEDULER_CONFIG,
            GUIDER_CONFIG, _CHAT_TEMPLATE, seed, "qwen-layout"]
    if image_to_video:
        spec += ["i2v", tiny_image_encoder_config()]

    def build():
        import torch
        from diffusers import (
            AutoencoderKLHunyuanVideo15,
            FlowMatchEulerDiscreteScheduler,
            HunyuanVideo15ImageToVideoPipeline,
            HunyuanVideo15Pipeline,
            HunyuanVideo15Transformer3DModel,
        )
        from diffusers.guiders import ClassifierFreeGuidance
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, SiglipVisionConfig, SiglipVisionModel, T5Config, T5EncoderModel

        configs = text_configs
        torch.manual_seed(seed)
        parts = dict(
            text_encoder=Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**configs["text_encoder"])).eval(),
            tokenizer=tiny_qwen_tokenizer(),
            transformer=HunyuanVideo15Transformer3DModel(**transformer_config).eval(),
            vae=AutoencoderKLHunyuanVideo15(**vae_config).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
            text_encoder_2=T5EncoderModel(T5Config(**configs["text_encoder_2"])).eval(),
            tokenizer_2=ByT5Tokenizer(),
            guider=ClassifierFreeGuidance(**GUIDER_CONFIG),
        )
        if not image_to_video:
            return HunyuanVideo15Pipeline(**parts)
        return HunyuanVideo15ImageToVideoPipeline(
            **parts, image_encoder=SiglipVisionModel(SiglipVisionConfig(**tiny_image_encoder_config())).eval(),
            feature_extractor=tiny_image_processor())

    return checkpoints.cached_pipeline("hunyuan-tiny" + ("-i2v" if image_to_video else ""), spec, build, directory,
                                       finish=lambda path: tokenizer_files.write_qwen_bpe(path / "tokenizer", tiny_qwen_tokenizer()))


def model_source(preset: Any, model: "str | os.PathLike | None" = None,
                 image_to_video: bool = False) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$TPUPEDIA_HUNYUAN`,
    else the preset's (`FULL_ID` for full, `FULL_ID_I2V` with `image_to_video`; the tiny checkpoint
    of that kind, labelled `preset:tiny` or `preset:tiny-i2v`)."""
    if image_to_video:
        source, label = checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID_I2V,
                                                  lambda: tiny_checkpoint(image_to_video=True))
        return source, (label + "-i2v" if label.startswith("preset:") else label)
    return checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID, tiny_checkpoint)


def named_source(model: "str | os.PathLike | None" = None) -> str | None:
    """The checkpoint the user named (`model`, else `$TPUPEDIA_HUNYUAN`), or `None` for the preset's."""
    return checkpoints.named_source(model, ENV_MODEL)


def component_configs(source: str) -> dict[str, dict]:
    """The checkpoint's component configs (no weights read), minus version and path entries; for
    an image-to-video checkpoint (its `model_index.json` names an image encoder) also the image
    encoder's and `pipeline`: the library and class of its `feature_extractor`."""
    import diffusers
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import AutoConfig

    index = checkpoints.read_configs(source, {"pipeline": lambda s: diffusers.DiffusionPipeline.load_config(s)})["pipeline"]
    configs = checkpoints.read_configs(source, {
        "transformer": lambda s: HunyuanVideo15Transformer3DModel.load_config(s, subfolder="transformer"),
        "vae": lambda s: AutoencoderKLHunyuanVideo15.load_config(s, subfolder="vae"),
        "scheduler": lambda s: FlowMatchEulerDiscreteScheduler.load_config(s, subfolder="scheduler"),
        "guider": lambda s: ClassifierFreeGuidance.load_config(s, subfolder="guider"),
        "text_encoder": lambda s: AutoConfig.from_pretrained(s, subfolder="text_encoder").to_dict(),
        "text_encoder_2": lambda s: AutoConfig.from_pretrained(s, subfolder="text_encoder_2").to_dict(),
    })
    if (index.get("image_encoder") or [None])[0] is not None:  # SigLIP: an image-to-video checkpoint
        configs |= checkpoints.read_configs(source, {
            "image_encoder": lambda s: AutoConfig.from_pretrained(s, subfolder="image_encoder").to_dict()})
        configs["pipeline"] = {"feature_extractor": index["feature_extractor"]}
    return configs


def tiny_release_checkpoint(name: str) -> Path:
    """The tiny checkpoint of release `name`'s layout (`FEW_STEP`): image-to-video with the
    step-distilled transformer's second timestep embedding (`use_meanflow`)."""
    if name not in FEW_STEP:
        raise ModelInputError(f"release {name!r} is not one of {', '.join(FEW_STEP)}")
    return tiny_checkpoint(image_to_video=True, transformer={"use_meanflow": True})


def tiny_release_adapters(_name: str, _source: str) -> dict[str, Path]:
    """The step-distilled releases are whole checkpoints: no adapters."""
    return {}
