"""Wan 2.1 / 2.2 text-to-video: every fact about the family in one place.

Wan (Alibaba's Wan team; diffusers' `WanPipeline`) is a flow-matching video transformer: umT5-XXL
encodes the prompt into 512 tokens of width 4096, padded with zeros after its last real token;
the transformer (40 blocks of 40 heads of 128 in the 14B models) attends over the video tokens
(patches of 1x2x2 latents) and cross-attends to the text; a causal 3D VAE compresses 4x in time
and 8x in space into 16 channels; the scheduler is UniPC, a multistep predictor-corrector, on
flow sigmas shifted by the checkpoint's `flow_shift`.

Wan 2.2 A14B is two such transformers, *experts*: `transformer` denoises the high-noise steps,
`transformer_2` the rest, switched at `boundary_ratio * num_train_timesteps` (the checkpoint's
`model_index.json`), each with its own guidance scale. Wan 2.2 TI2V-5B gives every video token
its own timestep (`expand_timesteps`).

Image-to-video (Wan2.1-I2V, Wan2.2-I2V-A14B; diffusers' `WanImageToVideoPipeline`) feeds the
transformer more input channels than it predicts: beside the 16 noisy latent channels, a mask
(4 channels: which of the 4 frames folded into each latent frame are given) and the VAE's
latents of the picture followed by black frames (16): 36 in, 16 out (`i2v_transformer_config`).
Wan 2.1's I2V also cross-attends to the picture's CLIP ViT-H/14 features (`image_dim`, an
`image_encoder` component); Wan 2.2's does not.

Shape facts come from the checkpoint's configs as diffusers reads them (`shape_facts`: the VAE's
`scale_factor_spatial` and `scale_factor_temporal`, the transformer's `patch_size`, the VAE's
`z_dim`); the constants here are the 14B releases' and only defaults. Introduced in notebook `wan_on_tpu`
(Wan on TPU); the dry-run and the plan read the same facts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tpupedia.models import ModelInputError, checkpoints, tokenizer_files
from tpupedia.models.shapes import ShapeFacts
from tpupedia.models.spec import FamilySpec, FewStepRelease, QuotedFigure, ReleaseAdapter

__all__ = ["QUANTIZE_KEEP", "attention_call", "REPORTED_STEPS", "REPORTED_STAGES", "REPORTED_ELSEWHERE", "FAMILY", "FULL_ID", "FULL_ID_22", "CACHE_BLOCKS", "CACHE_TEXT_STREAM", "FULL_LAYERS", "DEFAULT_SHAPES", "TEXT_TOKENS", "TEXT_DIM",
           "SPLASH_BLOCK_SIZES", "SCHEDULER_CONFIG", "SHARDING", "SPEC", "ENV_MODEL", "ModelInputError",
           "full_transformer_config", "full_configs", "tiny_transformer_config", "tiny_vae_config",
           "tiny_text_encoder_config", "TI2V_VAE", "default_request", "shape_facts", "check_frames", "check_size",
           "latent_shape", "video_tokens", "step_flops", "build", "step_inputs", "tiny_checkpoint",
           "model_source", "named_source", "component_configs", "experts", "boundary_timestep", "make_vae_jit_friendly",
           "FULL_ID_I2V", "FULL_ID_22_I2V", "i2v_transformer_config", "image_to_video", "full_image_encoder_config",
           "tiny_image_encoder_config", "tiny_image_processor", "condition_mask", "FLOAT32_COMPONENTS", "VAE_DTYPES",
           "component_dtype", "flow_shift", "SMALL_ID", "TI2V_ID", "SIZES", "TI2V_VAE_CONFIG", "RELEASE_REQUESTS",
           "LIGHTNING", "FEW_STEP", "tiny_release_checkpoint", "tiny_release_adapters", "lightning_layout_adapter"]

FAMILY = "wan"
FULL_ID = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
FULL_ID_22 = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
"""Wan 2.2's two-expert text-to-video release (`--model`); the full preset loads Wan 2.1."""
FULL_ID_I2V = "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"
"""The image-to-video release the full preset loads for a request with a picture."""
FULL_ID_22_I2V = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
"""Wan 2.2's two-expert image-to-video release (`--model`); no image encoder."""
SMALL_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
"""Wan 2.1's 1.3B text-to-video release (`--model`): one that fits a single small TPU chip."""
TI2V_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
"""Wan 2.2's 5B text(-image)-to-video release (`--model`): one transformer, its own 16x VAE of 48
latent channels, a timestep per video token (`expand_timesteps`)."""
SIZES: dict[str, dict[str, int]] = {
    # diffusers' `WanTransformer3DModel` defaults; the Wan team's wan/configs/wan_t2v_14B.py.
    "14B": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16),
    # huggingface/diffusers scripts/convert_wan_to_diffusers.py (commit 0122271c4138fc3cf624e4d023e3a6bb76a30a71),
    # get_transformer_config("Wan-T2V-1.3B"); the Wan team's wan/configs/wan_t2v_1_3B.py (dim 1536 = 12 x 128).
    "1.3B": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30, in_channels=16, out_channels=16),
    # huggingface/diffusers scripts/convert_wan_to_diffusers.py (commit 7d5682739a1ee5b25bb9f5a81c573ea7e38d8e22),
    # get_transformer_config("Wan2.2-TI2V-5B"); Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py (dim 3072 = 24 x 128,
    # ffn_dim 14336, 30 layers; in_dim 48, the VAE's z_dim).
    "5B": dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48),
}
"""The transformer sizes of the releases, in diffusers' names (all heads of 128, text width 4096,
patches 1x2x2): what `full_transformer_config(size=...)` builds."""
FULL_LAYERS = 40
TEXT_TOKENS = 512  # the pipeline's max_sequence_length: umT5 tokens, zero-padded after the prompt
TEXT_DIM = 4096  # umT5-XXL's width
DEFAULT_SHAPES = ShapeFacts(spatial=8, temporal=4, patch=2, patch_t=1, latent_channels=16)
"""The 14B releases' shape facts (Wan 2.1 and 2.2 A14B share the VAE): the presets' and the dry-run's."""
ENV_MODEL = "TPUPEDIA_WAN"
"""Environment variable naming a checkpoint (hub id or directory) to use instead of the preset's."""
TEXT_ENCODERS = {"text_encoder": "t5"}
"""The text encoder and its `tpupedia.sharding` architecture table (umT5 uses T5's names; 11 GB in bf16)."""
TRANSFORMER_CLASS = "WanTransformer3DModel"
"""The diffusers class of the transformer(s) the pipeline loads (`tpupedia.lora` builds it on `meta` to check an adapter)."""
LORA_LOADER = "WanLoraLoaderMixin"
"""diffusers' LoRA loader for this family's pipelines (`tpupedia.lora`: how `--lora` reads an adapter, the
community layouts it converts included)."""
CACHE_BLOCKS = "blocks"
"""Step caches (`tpupedia.pipelines.stepcache`): the transformer's block list a cached step
skips, whose first block (FBCache), cut (DeepCache's tail) and last block cache."""
CACHE_TEXT_STREAM = False
"""Step caches: a `WanTransformerBlock` returns the video stream only; the text is the cross-attention's context, the same every block (diffusers registers it for FirstBlockCache and MagCache with no encoder index)."""
SPLASH_BLOCK_SIZES = (2048, 2048, 512)
"""Splash `(block_q, block_kv, block_kv_compute)` for the video self-attention: a starting point,
not tuned on a TPU (the cross-attention's 512 text keys cap the KV blocks at 512); `tpupedia plan
wan` checks they compile for v6e at the release shape; `--block-sizes` overrides."""

REPORTED_STEPS = (
    dict(resolution="1280x720", frames=81, mesh=(2, 4), sharding="tp", step_s=4.6, steps=50,
         source="tpu/Wan2.1/README.md (three-stage table, 720p)"),
    dict(resolution="848x480", frames=81, mesh=(2, 4), sharding="tp", step_s=1.37, steps=50,
         source="tpu/Wan2.1/README.md (three-stage table, 480p)"),
)
"""Wan 2.1 14B step times reported upstream on a TPU v6e-8 (yangwhale/gpu-tpu-pedia, commit
3fa9ce1), with the mesh and sharding table the runs used (`tpupedia.predict`)."""

REPORTED_STAGES = (
    dict(stage="decode", what="run", resolution="848x480", frames=81, seconds=0.50,
         source="tpu/Wan2.1/README.md (three-stage table, 480p: Stage3 VAE decoder ~0.50 s)"),
    dict(stage="denoise", what="compile", resolution="848x480", frames=81, seconds=93,
         source="tpu/Wan2.1/README.md (three-stage table, 480p: Stage2 warm-up, JIT, ~93 s)"),
)
"""Wan 2.1 14B stage times other than a denoising step reported upstream on a TPU v6e-8, mesh dp=2,
tp=4: a stage's run time (`what="run"`) or its compile time (`"compile"`), what `tpupedia plan`'s
predictions are set against (`tpupedia.predict.reported_stage`). The text stage's ~3 s is the
stage's wall time and left out."""


_MAXDIFFUSION = ("AI-Hypercomputer/maxdiffusion, commit 7cfb880, README.md, \"Ring Attention\": e2e generation time of "
                 "one 720p (81 frames) video with the guidance pair on dp, Tokamax flash attention")
REPORTED_ELSEWHERE = (
    dict(project="MaxDiffusion", model=FULL_ID, accelerator="v7x-8", topology="tpu7x:2x2x1", resolution="1280x720",
         frames=81, steps=50, seconds=249.3, mesh="dp2-fsdp1-context4-tp1", source=_MAXDIFFUSION),
    dict(project="MaxDiffusion", model=FULL_ID_22, accelerator="v7x-8", topology="tpu7x:2x2x1", resolution="1280x720",
         frames=81, steps=40, seconds=194.4, mesh="dp2-fsdp1-context4-tp1", source=_MAXDIFFUSION),
    dict(project="MaxDiffusion", model=FULL_ID, accelerator="v7x-16", topology="tpu7x:2x2x2", resolution="1280x720",
         frames=81, steps=50, seconds=127.1, mesh="dp2-fsdp1-context8-tp1", source=_MAXDIFFUSION),
    dict(project="MaxDiffusion", model=FULL_ID_22, accelerator="v7x-16", topology="tpu7x:2x2x2", resolution="1280x720",
         frames=81, steps=40, seconds=106.0, mesh="dp2-fsdp1-context8-tp1", source=_MAXDIFFUSION),
)
"""Whole runs another implementation reports on TPU7x (reported, not measured here): MaxDiffusion's
Wan 2.1 (14B) and Wan 2.2 (A14B; its table says neither text- nor image-to-video) at 720p. A
"v7x-8" is eight TensorCores, the eight devices of its `dp2 x context4` mesh: four chips, libtpu's
`tpu7x:2x2x1`. The results page sets this course's predicted runs of the same videos beside them
(`tpupedia.plan.recorded_run`): another implementation, context parallelism where this course
uses tp, its kernels tuned on TPU7x."""

# The scheduler the Wan 2.1 14B diffusers checkpoints ship (scheduler/scheduler_config.json):
# UniPC on flow sigmas, second order, B(h) = expm1(h), shift 3.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0,
    solver_order=2, solver_type="bh2", lower_order_final=True, predict_x0=True, final_sigmas_type="zero",
    timestep_spacing="linspace")
FLOAT32_COMPONENTS: tuple[str, ...] = ("vae", "image_encoder")
"""The components stock diffusers' Wan examples keep in float32 beside a bf16 pipeline, and so
does a run here: `WanPipeline`'s example (diffusers 0.42.1, `pipelines/wan/pipeline_wan.py`,
`EXAMPLE_DOC_STRING`) loads `AutoencoderKLWan.from_pretrained(model_id, subfolder="vae",
torch_dtype=torch.float32)`, and `WanImageToVideoPipeline`'s (`pipeline_wan_i2v.py`) the VAE and
`CLIPVisionModel` the same way. One exception, decided by the plan and said where it is made: a
video whose float32 VAE stages do not fit a chip runs its VAE in the run's dtype
(`Request.vae_dtype`, `tpupedia.pipelines.wan.Wan.lowered`). The run loads these components,
the plan compiles them and the stage files record them in the dtype `component_dtype` gives.
Introduced in notebook `wan_on_tpu`."""
VAE_DTYPES = ("float32", "bfloat16")
"""What `--vae-dtype` accepts."""


def component_dtype(name: str, dtype: str, vae_dtype: str | None = None) -> str:
    """The dtype (a name: `"bfloat16"`, `"float32"`) component `name` runs in when the run's is
    `dtype`: the VAE in `vae_dtype` where one is given (`Request.vae_dtype`); otherwise float32
    for `FLOAT32_COMPONENTS`, else `dtype`."""
    if name == "vae" and vae_dtype is not None:
        return vae_dtype
    return "float32" if name in FLOAT32_COMPONENTS else dtype


def flow_shift(configs: dict[str, dict], shift: float | None = None) -> float:
    """The flow shift UniPC's sigmas use: `shift` if given (the user's `--shift`, what stock users
    set with `UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=...)`; diffusers'
    `WanPipeline` example uses 5.0 for 720p, 3.0 for 480p), else the checkpoint's scheduler's
    `flow_shift` (UniPC's default 1.0 where its config has none)."""
    return float(configs["scheduler"].get("flow_shift", 1.0) if shift is None else shift)


BOUNDARY_RATIO = 0.875
"""Wan 2.2 T2V-A14B's switch from the high-noise to the low-noise expert (its `model_index.json`)."""
BOUNDARY_RATIO_I2V = 0.9
"""Wan 2.2 I2V-A14B's switch (its `model_index.json`; the Wan team's config says `boundary = 0.900`)."""

# Sharding tables for the transformer (diffusers `WanTransformer3DModel` names): self-attention
# (`attn1`) and cross-attention (`attn2`) projections and the FFN as Megatron pairs. Wan 2.1
# I2V's cross-attention has keys and values of its own for the picture's CLIP tokens
# (`add_k_proj`, `add_v_proj`: 3.9 GiB per chip at 14B if left whole), split like `to_k`/`to_v`.
_COL = (r"(attn1\.to_q|attn1\.to_k|attn1\.to_v|attn2\.to_q|attn2\.to_k|attn2\.to_v|attn2\.add_k_proj|"
        r"attn2\.add_v_proj|ffn\.net\.0\.proj)")
_ROW = r"(attn1\.to_out\.0|attn2\.to_out\.0|ffn\.net\.2)"
QUANTIZE_KEEP: tuple[tuple[str, str], ...] = (
    (r"condition_embedder\..*", "the timestep and text embedders and the timestep's projection to every block's "
                                  "modulation: small next to the blocks, and they condition all of them"),
    (r"proj_out", "the projection to latents: its errors are the prediction's"),
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
    "fsdp": [
        (rf".*\.({_COL[1:-1]}|{_ROW[1:-1]})\.weight", ("fsdp", None)),
    ],
    "replicated": [],
}

LIGHTNING_REPO = "lightx2v/Wan2.2-Lightning"
LIGHTNING_FOLDER = "Wan2.2-T2V-A14B-4steps-lora-rank64-Seko-V1.1"
LIGHTNING = FewStepRelease(
    name="lightning", title="Wan2.2-T2V-A14B with the Lightning 4-step LoRAs (V1.1), one per expert, guidance off",
    model=FULL_ID_22, steps=4, guidance=1.0, fields={"guidance_2": 1.0, "shift": 5.0, "solver": "euler"},
    adapters=(ReleaseAdapter(LIGHTNING_REPO, f"{LIGHTNING_FOLDER}/high_noise_model.safetensors", "transformer", 64),
              ReleaseAdapter(LIGHTNING_REPO, f"{LIGHTNING_FOLDER}/low_noise_model.safetensors", "transformer_2", 64)),
    sources=(
        "steps 4, guidance (1.0, 1.0) for the low- and high-noise experts, shift 5.0: the Lightning code's "
        "wan/configs/wan_t2v_A14B.py (ModelTC/Wan2.2-Lightning: sample_steps = 4, sample_guide_scale = (1.0, 1.0), "
        "sample_shift = 5.0, boundary = 0.875, Wan 2.2's own)",
        "adapters: the README of ModelTC/Wan2.2-Lightning (hf download lightx2v/Wan2.2-Lightning; news of "
        "Aug 07, 2025: Wan2.2-T2V-A14B-4steps-lora-rank64-Seko-V1.1), one file per expert, high_noise_model for the "
        "high-noise expert (diffusers' transformer), low_noise_model for the low-noise one (transformer_2); rank 64 by "
        "the folder's name; keys in the original Wan layout (diffusion_model.blocks.N.self_attn.q.lora_down.weight, "
        "lora_up, alpha), which diffusers' WanLoraLoaderMixin converts",
        "solver euler: the Lightning code's generate.py (--sample_solver defaults to euler, and any other with "
        "adapters warns that Euler is \"used in distillation\") and wan/utils/fm_solvers_euler.py (EulerScheduler: "
        "sigmas evenly spaced from 1 to 0, shifted; ModelTC/Wan2.2-Lightning at 92efeb4)",
    ),
    note="the Lightning authors' Euler (evenly spaced sigmas, shifted), which their adapters were distilled with; stock "
         "WanPipeline with the adapters loaded keeps the checkpoint's UniPC (--solver unipc)",
)
"""Wan 2.2 A14B with the Lightning LoRAs: 4 steps, guidance off for both experts (`--release lightning`)."""
FEW_STEP = {LIGHTNING.name: LIGHTNING}
"""The family's few-step releases by name (`FamilySpec.few_step`)."""

SPEC = FamilySpec(
    name=FAMILY, module=__name__, full_id=FULL_ID, sharding=SHARDING, mask="padding", layer_prefix="blocks.0.",
    title="Wan 2.1 / 2.2 (14B t2v on the full preset): umT5 -> transformer (or two experts) -> VAE",
    releases={FULL_ID: {}, FULL_ID_22: {"experts": 2}, FULL_ID_I2V: {"image_to_video": True},
              FULL_ID_22_I2V: {"experts": 2, "image_to_video": True}, SMALL_ID: {"size": "1.3B"},
              TI2V_ID: {"size": "5B"}},
    few_step=FEW_STEP,
    figures=tuple(
        QuotedFigure(f"plan.wan.ti2v5b.v5e1.{name}.{what}", read, stage="denoise" if what == "denoise_gib" else None,
                     decimals=2, text=(lambda v: f"{v / 60:.1f} min") if what == "predicted" else None,
                     match={"checkpoint": TI2V_ID, "topology": "v5e:1x1", "stages": ("text", "denoise"),
                            "request": lambda q, fmt=fmt: (q.get("quantize"), q["width"]) == (fmt, 1280)},
                     source=f"docs/results/plans.json: tpupedia plan wan --model {TI2V_ID} --topology v5e:1x1"
                            + (f" --quantize {fmt}" if fmt else "") + " (AOT here, one layer compiled, 1280x704, 121 frames)")
        for name, fmt, what, read in (("bf16", None, "denoise_gib", "plan_peak"), ("int8", "int8", "denoise_gib", "plan_peak"),
                                      ("int8", "int8", "predicted", "plan_predicted"))),
)
"""This family in the registry (`tpupedia.families`)."""


# --- configs -----------------------------------------------------------------------------------

def full_transformer_config(layers: int | None = None, size: str = "14B") -> dict[str, Any]:
    """A release's transformer (`SIZES`): Wan 2.1 T2V 14B's by default (each Wan 2.2 A14B expert
    has the same shapes), 40 blocks of 40 heads of 128, FFN 13,824; `"1.3B"` (30 blocks of 12
    heads) or `"5B"` (Wan 2.2 TI2V: 30 blocks of 24 heads over 48 latent channels). `layers`
    overrides the block count (a shallow plan)."""
    if size not in SIZES:
        raise ModelInputError(f"size={size!r} is not one of {', '.join(SIZES)}")
    facts = SIZES[size]
    return dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=TEXT_DIM, freq_dim=256,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
                **(facts | {"num_layers": facts["num_layers"] if layers is None else layers}))


def full_text_encoder_config() -> dict[str, Any]:
    """umT5-XXL's encoder: 24 layers of width 4096, 64 heads, gated-GELU FFN of 10,240, 256,384 ids."""
    return dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", dense_act_fn="gelu_new",
                is_gated_act=True, tie_word_embeddings=False)


def full_configs(experts: int = 1, image_to_video: bool = False, size: str = "14B") -> dict[str, dict]:
    """The release's component configs, as `component_configs` reads them, for planning without a
    download (`tpupedia plan`): Wan 2.1 14B, or with `experts=2` Wan 2.2 A14B (a second
    transformer of the same shapes and the boundary). `image_to_video`: the I2V releases' (36
    input channels; Wan 2.1's CLIP image encoder and the transformer's image projections).
    `size="1.3B"`: Wan2.1-T2V-1.3B (`SMALL_ID`: the 14B's VAE, text encoder and scheduler);
    `size="5B"`: Wan2.2-TI2V-5B (`TI2V_ID`: its own VAE, `TI2V_VAE_CONFIG`, flow shift 5 and
    `expand_timesteps`)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config

    ti2v = size == "5B"
    with torch.device("meta"):
        transformer = dict(WanTransformer3DModel(**full_transformer_config(layers=1, size=size)).config)
        vae = dict(AutoencoderKLWan(**(TI2V_VAE_CONFIG if ti2v else {})).config)
    transformer |= {"num_layers": SIZES[size]["num_layers"]}
    if image_to_video:
        image_dim = None if experts == 2 else full_image_encoder_config()["hidden_size"]
        transformer = i2v_transformer_config(transformer, vae["z_dim"], DEFAULT_SHAPES.temporal, image_dim)
    scheduler = SCHEDULER_CONFIG | ({"flow_shift": TI2V_FLOW_SHIFT} if ti2v else {})
    configs = {"transformer": transformer, "vae": vae, "scheduler": dict(UniPCMultistepScheduler(**scheduler).config),
               "text_encoder": UMT5Config(**full_text_encoder_config()).to_dict(),
               "pipeline": {"boundary_ratio": None, "expand_timesteps": ti2v}}
    if experts == 2:
        ratio = BOUNDARY_RATIO_I2V if image_to_video else BOUNDARY_RATIO
        configs |= {"transformer_2": dict(transformer), "pipeline": {"boundary_ratio": ratio, "expand_timesteps": False}}
    elif image_to_video:
        from transformers import CLIPVisionConfig

        configs["image_encoder"] = CLIPVisionConfig(**full_image_encoder_config()).to_dict()
    return configs


def full_image_encoder_config() -> dict[str, Any]:
    """Wan 2.1 I2V's image encoder: OpenCLIP ViT-H/14 (the Wan team's `clip_xlm_roberta_vit_h_14`)
    as a transformers `CLIPVisionModel`: 32 layers of width 1280, 16 heads, patches of 14 over 224
    px, so 257 tokens (256 patches and the class token)."""
    return dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5)


def i2v_transformer_config(config: dict[str, Any], z_dim: int, temporal: int, image_dim: int | None = None) -> dict[str, Any]:
    """`config` (a text-to-video transformer's) in the image-to-video layout: the input takes the
    noisy latents, the mask (`temporal` channels, one per frame folded into a latent frame) and
    the picture's latents (`z_dim`): 36 channels for the releases' 16. With `image_dim` (Wan 2.1
    I2V: the CLIP features' width) the transformer embeds the picture's features and each block's
    cross-attention reads them through its own key and value projections (`added_kv_proj_dim`,
    the model's width)."""
    out = config | {"in_channels": 2 * z_dim + temporal}
    if image_dim is not None:
        out |= {"image_dim": image_dim, "added_kv_proj_dim": config["num_attention_heads"] * config["attention_head_dim"]}
    return out


def image_to_video(configs: dict[str, dict]) -> bool:
    """Whether a checkpoint (its component configs) generates from a picture: its transformer takes
    the mask and the picture's latents beside the noisy latents (`i2v_transformer_config`)."""
    facts = shape_facts(configs)
    transformer = configs.get("transformer") or configs["transformer_2"]
    return transformer["in_channels"] == 2 * facts.latent_channels + facts.temporal


def tiny_transformer_config() -> dict[str, Any]:
    """2 blocks of 2 heads of 8 over 4-channel latents: Wan's architecture (patch 1x2x2, RMS
    norm across heads, cross-attention norm) at CPU size."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def tiny_vae_config() -> dict[str, Any]:
    """The released VAE's structure (4 levels: 8x in space, 4x in time) at base width 8 and 4 latent
    channels, with per-channel latent statistics that are not 0 and 1, so the de-normalisation shows."""
    return dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
                latents_mean=[-0.25, 0.5, 0.1, -0.7], latents_std=[2.0, 1.5, 0.8, 2.5])


def tiny_image_encoder_config() -> dict[str, Any]:
    """A 2-layer CLIP vision tower (width 16, patches of 8 over 32 px: 17 tokens), the ViT-H/14's
    structure at CPU size."""
    return dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                patch_size=8, projection_dim=16, hidden_act="gelu", layer_norm_eps=1e-5)


def tiny_image_processor():
    """The release's CLIP preprocessing (shortest side resized bicubic, centre crop, CLIP's mean
    and std) at the tiny tower's 32 px: `CLIPImageProcessorPil`, the PIL backend of the
    `CLIPImageProcessor` the release names (whose default backend needs torchvision)."""
    from transformers import CLIPImageProcessorPil

    side = tiny_image_encoder_config()["image_size"]
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


TI2V_VAE = dict(is_residual=True, in_channels=12, out_channels=12, patch_size=2, decoder_base_dim=16,
                scale_factor_spatial=16)
"""What Wan 2.2 TI2V-5B's VAE changes (its config in Wan-AI/Wan2.2-TI2V-5B-Diffusers): residual
blocks, pixels patchified 2x2 into 12 channels, a wider decoder, 16x in space in all; the tiny
checkpoint's `vae` override for that layout."""


# Wan2.2-TI2V-5B's VAE (its vae/config.json), from huggingface/diffusers
# scripts/convert_wan_to_diffusers.py (commit 7d5682739a1ee5b25bb9f5a81c573ea7e38d8e22),
# `vae22_diffusers_config`; the rest (dim_mult [1, 2, 4, 4], num_res_blocks 2, temperal_downsample)
# are `AutoencoderKLWan`'s defaults (its `clip_output=False` is no argument of this diffusers). 48 latent
# channels, 16x in space (2x2 patchify, then 8x).
TI2V_VAE_CONFIG: dict[str, Any] = TI2V_VAE | dict(
    base_dim=160, z_dim=48, scale_factor_temporal=4,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                  0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                  -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                  -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                  0.3573, -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
)
TI2V_FLOW_SHIFT = 5.0
"""Wan2.2-TI2V-5B's scheduler `flow_shift` (diffusers' conversion script, as above: 5.0 for TI2V;
Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py `sample_shift = 5.0`)."""

RELEASE_REQUESTS: dict[str, dict[str, Any]] = {
    # Wan-Video/Wan2.1 README: the 1.3B model runs 480p (832x480), 81 frames, at 16 fps
    # (wan/configs/shared_config.py sample_fps = 16); steps and guidance stay the family's defaults.
    SMALL_ID: dict(frames=81, height=480, width=832, fps=16),
    # Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py: frame_num 121, sample_fps 24, 50 steps, guide scale 5.0;
    # its README's 720p is 1280x704 (SUPPORTED_SIZES "ti2v-5B": 704*1280, 1280*704).
    TI2V_ID: dict(frames=121, height=704, width=1280, fps=24, steps=50, guidance=5.0),
    # Wan-Video/Wan2.1 generate.py @ 9737cba: text-to-video 50 steps, image-to-video 40, flow shift 5.0
    # (3.0 only for image-to-video at 480p), guide scale 5.0. Stock WanPipeline keeps the checkpoint's
    # scheduler (flow_shift 3.0); diffusers' own 720p example sets 5.0, as the authors do.
    FULL_ID: dict(shift=5.0),
    FULL_ID_I2V: dict(steps=40, shift=5.0),
    # Wan-Video/Wan2.2 @ 42bf4cf, wan/configs/wan_t2v_A14B.py: 40 steps, sample_shift 12.0, sample_guide_scale
    # (3.0, 4.0) for the low- and high-noise experts (ours: guidance_2 and guidance); wan_i2v_A14B.py: 40 steps,
    # shift 5.0, (3.5, 3.5). Both 81 frames at 16 fps (shared_config.py), the full preset's.
    FULL_ID_22: dict(steps=40, shift=12.0, guidance=4.0, guidance_2=3.0),
    FULL_ID_22_I2V: dict(steps=40, shift=5.0, guidance=3.5, guidance_2=3.5),
}
"""Each built-in release whose default video differs from the full preset's (`default_request`):
the fields `tpupedia plan --model ID` starts from (`StagedPipeline.release_request`)."""


def tiny_text_encoder_config() -> dict[str, Any]:
    """A 2-layer umT5 encoder over the tiny SentencePiece vocabulary (at most 96 pieces + 100 extra ids)."""
    return dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dense_act_fn="gelu_new",
                is_gated_act=True, tie_word_embeddings=False)


def default_request(preset: Any) -> dict[str, Any]:
    """Frames, size, steps, guidance, seed and fps a preset generates by default: the full preset
    720p and 81 frames at 16 fps (what the releases and MaxDiffusion run), 50 steps, guidance 5
    (`WanPipeline`'s default); the tiny preset seconds on a CPU."""
    if preset.pretrained:
        return dict(frames=81, height=720, width=1280, steps=50, guidance=5.0, seed=42, fps=16)
    return dict(frames=9, height=64, width=64, steps=4, guidance=5.0, seed=42, fps=8)


# --- shape facts and rules ---------------------------------------------------------------------

def shape_facts(configs: dict[str, dict]) -> ShapeFacts:
    """A checkpoint's shape facts, as `WanPipeline` reads them: the VAE's `scale_factor_spatial`
    and `scale_factor_temporal` (8 and 4 where the config predates them), the transformer's
    `patch_size` (t, h, w) and the VAE's `z_dim`."""
    vae, transformer = configs["vae"], configs.get("transformer") or configs["transformer_2"]
    p_t, p_h, p_w = transformer["patch_size"]
    if p_h != p_w:
        raise ModelInputError(f"transformer patch_size {tuple(transformer['patch_size'])}: only square patches "
                              "(equal height and width) are supported")
    return ShapeFacts(spatial=int(vae.get("scale_factor_spatial") or 8), temporal=int(vae.get("scale_factor_temporal") or 4),
                      patch=int(p_h), patch_t=int(p_t), latent_channels=int(vae["z_dim"]))


def check_frames(frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a frame count the VAE cannot produce exactly: temporal * n + 1 (4n+1 for the releases).
    `WanPipeline` rounds it down with a warning; here the request is refused, naming both."""
    if not facts.frames_ok(frames):
        t = facts.temporal
        rounded = facts.frames_for(facts.latent_frames(max(1, frames))) if isinstance(frames, int) else "?"
        raise ModelInputError(
            f"frames={frames}: Wan generates {t}n+1 frames (the VAE keeps the first frame and compresses the rest "
            f"{t}x in time), e.g. {t * 2 + 1}, {t * 20 + 1}; diffusers would round {frames} down to {rounded}")


def check_size(width: int, height: int, facts: ShapeFacts = DEFAULT_SHAPES) -> None:
    """Refuse a size that does not tile into whole patches: positive multiples of spatial * patch (16).
    `WanPipeline` rounds it down with a warning."""
    if not facts.size_ok(width, height):
        raise ModelInputError(f"size {width}x{height}: width and height must be positive multiples of "
                              f"{facts.size_multiple} (the VAE compresses {facts.spatial}x, patches of {facts.patch})")


def latent_shape(frames: int, height: int, width: int, facts: ShapeFacts = DEFAULT_SHAPES) -> tuple[int, ...]:
    """`(1, C, T, H/8, W/8)`, the latents `WanPipeline.prepare_latents` draws."""
    return (1, facts.latent_channels, facts.latent_frames(frames), *facts.latent_size(height, width))


def condition_mask(frames: int, height: int, width: int, facts: ShapeFacts = DEFAULT_SHAPES) -> Any:
    """The mask channels of image-to-video's condition, `(1, temporal, latent frames, height, width)`
    float32 (latent `height` x `width`): which pixel frames are given. The VAE folds the first frame
    alone into latent frame 0 and `temporal` frames into each later one; the mask repeats the first
    frame `temporal` times so that every latent frame has `temporal` channels, one per pixel frame:
    all ones in latent frame 0 (the picture), zeros after (frames to generate)."""
    import torch

    mask = torch.zeros(1, facts.temporal, facts.latent_frames(frames), height, width)
    mask[:, :, 0] = 1.0
    return mask


def video_tokens(width: int, height: int, frames: int, facts: ShapeFacts = DEFAULT_SHAPES) -> int:
    """Video tokens of one sample: latent frames / patch_t times (height / 16) times (width / 16)."""
    per = facts.size_multiple
    return facts.latent_frames(frames) // (facts.patch_t or 1) * (height // per) * (width // per)


def attention_call(width: int, height: int, frames: int, configs: dict[str, dict]) -> tuple[int, int]:
    """`(heads, tokens)` of one sample's self-attention in the (first) transformer of `configs`:
    its heads and the request's video tokens (`video_tokens`, the checkpoint's shape facts); the
    cross-attention to the `TEXT_TOKENS` text tokens is smaller (`tpupedia.plan.gpu_attention`
    sizes the reference attention's scores from it)."""
    transformer = configs.get("transformer") or configs["transformer_2"]
    return int(transformer["num_attention_heads"]), video_tokens(width, height, frames, shape_facts(configs))


def step_flops(width: int, height: int, frames: int, layers: int = FULL_LAYERS, batch: int = 2, heads: int = 40,
               head_dim: int = 128, ffn: int = 13824, text_tokens: int = TEXT_TOKENS) -> dict[str, float]:
    """Matmul FLOPs of one transformer call (the guidance pair as `batch`): per block, the video
    tokens' self-attention projections (4 d^2), the cross-attention's query and output (2 d^2),
    the text tokens' keys and values (2 d^2) and the FFN (2 d ffn), times 2 FLOPs per multiply-add;
    attention scores and values over the video (4 T^2 d) and over the text (4 T L d)."""
    d = heads * head_dim
    t, n = video_tokens(width, height, frames), text_tokens
    linear = batch * layers * 2 * (t * (6 * d * d + 2 * d * ffn) + n * 2 * d * d)
    attention = batch * layers * 4 * (t * t + t * n) * d
    return {"tokens": t, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def build(layers: int | None = None, device: str = "meta", dtype: Any = None):
    """The full transformer (shapes only on `meta`), bf16 by default."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        return WanTransformer3DModel(**full_transformer_config(layers)).to(dtype or torch.bfloat16)


def step_inputs(width: int, height: int, frames: int, batch: int = 2) -> tuple[list, Any]:
    """`(input specs, call)` for the dry-run: latents, the timestep and the text, batch on `dp`."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    _, c, t, h, w = latent_shape(frames, height, width)
    specs = [((batch, c, t, h, w), jnp.bfloat16, P("dp")), ((batch,), jnp.float32, P("dp")),
             ((batch, TEXT_TOKENS, TEXT_DIM), jnp.bfloat16, P("dp"))]

    def call(fm, weights, buffers, x, timestep, text):
        return fm(weights, buffers, hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

    return specs, call


def make_vae_jit_friendly(vae):
    """`vae` (an `AutoencoderKLWan`) with each `WanUpsample` upsampling in its input's dtype.

    diffusers' `WanUpsample` upsamples `x.float()` and casts back with `type_as(x)`. Under torchax
    0.0.13 with bf16 weights, the convolution after it then fails its dtype check ("Input type
    (float) and bias type (c10::BFloat16) should be the same"; the plan's AOT compile found it).
    Its modes are nearest-neighbour (`nearest-exact`): values are copied, not mixed, so upsampling
    in bf16 gives exactly the bits of the float round trip. Returns `vae`, changed in place."""
    import types

    import torch.nn.functional as F
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    def same_dtype(self, x):
        return F.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode=self.mode,
                             align_corners=self.align_corners)

    for module in vae.modules():
        if isinstance(module, WanUpsample):
            if not module.mode.startswith("nearest"):
                raise ModelInputError(f"WanUpsample mode={module.mode!r}: only nearest-neighbour modes copy values "
                                      "exactly in any dtype")
            module.forward = types.MethodType(same_dtype, module)
    return vae


# --- experts ------------------------------------------------------------------------------------

def experts(configs: dict[str, dict]) -> tuple[str, ...]:
    """The transformers a checkpoint denoises with: `("transformer",)` for Wan 2.1,
    `("transformer", "transformer_2")` for Wan 2.2 A14B (its `model_index.json` names both and a
    `boundary_ratio`)."""
    two = "transformer_2" in configs and configs.get("pipeline", {}).get("boundary_ratio") is not None
    return ("transformer", "transformer_2") if two else ("transformer",)


def boundary_timestep(configs: dict[str, dict]) -> float | None:
    """The timestep below which `transformer_2` takes over (`boundary_ratio * num_train_timesteps`),
    or `None` with one expert."""
    ratio = configs.get("pipeline", {}).get("boundary_ratio")
    return None if ratio is None else ratio * configs["scheduler"]["num_train_timesteps"]


# --- weights: tiny checkpoints and loading -------------------------------------------------------

def tiny_checkpoint(directory: "str | os.PathLike | None" = None, seed: int = 0, experts: int = 1,
                    vae: dict | None = None, transformer: dict | None = None, expand_timesteps: bool = False,
                    image_to_video: bool = False) -> Path:
    """Write a whole random `WanPipeline` (umT5 encoder with a SentencePiece tokenizer in the
    diffusers checkpoints' layout, `tokenizer_files.write_t5_fast`; transformer, VAE, UniPC
    scheduler) with `save_pretrained` (safetensors) and return its directory (cached, named by its
    configs, written atomically). `experts=2` writes Wan 2.2's layout: a second transformer and
    the boundary in `model_index.json`. `vae` and `transformer` override config entries;
    `expand_timesteps` writes Wan 2.2 TI2V's flag (a timestep per latent token; with
    `TI2V_VAE` for that checkpoint's residual, patchified VAE). `image_to_video` writes a
    `WanImageToVideoPipeline` in the I2V releases' layout (`i2v_transformer_config`): with one
    expert Wan2.1-I2V's (a CLIP image encoder and its `CLIPImageProcessorPil`), with two
    Wan2.2-I2V-A14B's (no image encoder, its boundary)."""
    if experts not in (1, 2):
        raise ModelInputError(f"experts={experts}: Wan checkpoints have 1 (2.1) or 2 (2.2 A14B) transformers")
    transformer_config = tiny_transformer_config() | (transformer or {})
    vae_config = tiny_vae_config() | (vae or {})
    clip = image_to_video and experts == 1  # Wan 2.1 I2V: the picture's CLIP features too
    if image_to_video:
        transformer_config = i2v_transformer_config(
            transformer_config, vae_config["z_dim"], DEFAULT_SHAPES.temporal,
            tiny_image_encoder_config()["hidden_size"] if clip else None)
    spec = [transformer_config, vae_config, tiny_text_encoder_config(), SCHEDULER_CONFIG, seed, experts, "t5-fast",
            tokenizer_files.T5_CORPUS] + (["expand_timesteps"] if expand_timesteps else [])
    if image_to_video:
        spec += ["i2v", tiny_image_encoder_config() if clip else None]

    def write_tokenizer(folder):
        return tokenizer_files.write_t5_fast(folder, max_length=TEXT_TOKENS)

    def build():
        import tempfile

        import torch
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(tmp))
        torch.manual_seed(seed)
        parts = dict(tokenizer=tokenizer, text_encoder=UMT5EncoderModel(UMT5Config(**tiny_text_encoder_config())).eval(),
                     vae=AutoencoderKLWan(**vae_config).eval(), transformer=WanTransformer3DModel(**transformer_config).eval(),
                     scheduler=UniPCMultistepScheduler(**SCHEDULER_CONFIG))
        if experts == 2:
            parts |= dict(transformer_2=WanTransformer3DModel(**transformer_config).eval(),
                          boundary_ratio=BOUNDARY_RATIO_I2V if image_to_video else BOUNDARY_RATIO)
        if not image_to_video:
            return WanPipeline(**parts, expand_timesteps=expand_timesteps)
        from diffusers import WanImageToVideoPipeline
        from transformers import CLIPVisionConfig, CLIPVisionModel

        if clip:
            parts |= dict(image_encoder=CLIPVisionModel(CLIPVisionConfig(**tiny_image_encoder_config())).eval(),
                          image_processor=tiny_image_processor())
        return WanImageToVideoPipeline(**parts, expand_timesteps=expand_timesteps)

    name = "wan22-ti2v" if expand_timesteps else f"wan{'22' if experts == 2 else '21'}"
    name += "-i2v" if image_to_video else ""
    return checkpoints.cached_pipeline(f"{name}-tiny", spec, build, directory,
                                       finish=lambda path: write_tokenizer(path / "tokenizer"))


def model_source(preset: Any, model: "str | os.PathLike | None" = None,
                 image_to_video: bool = False) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$TPUPEDIA_WAN`, else
    the preset's (`FULL_ID` for full, `FULL_ID_I2V` with `image_to_video`; the tiny Wan 2.1
    checkpoint of that kind, labelled `preset:tiny` or `preset:tiny-i2v`)."""
    if image_to_video:
        source, label = checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID_I2V,
                                                  lambda: tiny_checkpoint(image_to_video=True))
        return source, (label + "-i2v" if label.startswith("preset:") else label)
    return checkpoints.choose_source(preset, model, ENV_MODEL, FULL_ID, tiny_checkpoint)


def named_source(model: "str | os.PathLike | None" = None) -> str | None:
    """The checkpoint the user named (`model`, else `$TPUPEDIA_WAN`), or `None` for the preset's."""
    return checkpoints.named_source(model, ENV_MODEL)


def component_configs(source: str) -> dict[str, dict]:
    """The checkpoint's component configs (no weights read), minus version and path entries, and
    `pipeline`: the `model_index.json` entries that change the run (`boundary_ratio`,
    `expand_timesteps`, and the `image_processor` library and class where it names one). A second
    transformer and an image encoder are read where `model_index.json` names them."""
    import diffusers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoConfig

    index = checkpoints.read_configs(source, {"pipeline": lambda s: diffusers.DiffusionPipeline.load_config(s)})["pipeline"]
    loaders = {
        "transformer": lambda s: WanTransformer3DModel.load_config(s, subfolder="transformer"),
        "vae": lambda s: AutoencoderKLWan.load_config(s, subfolder="vae"),
        "scheduler": lambda s: UniPCMultistepScheduler.load_config(s, subfolder="scheduler"),
        "text_encoder": lambda s: AutoConfig.from_pretrained(s, subfolder="text_encoder").to_dict(),
    }
    if (index.get("transformer_2") or [None])[0] is not None:
        loaders["transformer_2"] = lambda s: WanTransformer3DModel.load_config(s, subfolder="transformer_2")
    if (index.get("image_encoder") or [None])[0] is not None:  # Wan 2.1 I2V's CLIP vision tower
        loaders["image_encoder"] = lambda s: AutoConfig.from_pretrained(s, subfolder="image_encoder").to_dict()
    configs = checkpoints.read_configs(source, loaders)
    configs["pipeline"] = {"boundary_ratio": index.get("boundary_ratio"),
                           "expand_timesteps": bool(index.get("expand_timesteps", False))}
    if (index.get("image_processor") or [None])[0] is not None:  # the class that preprocesses the picture
        configs["pipeline"]["image_processor"] = index["image_processor"]
    return configs


# --- few-step releases on the tiny preset --------------------------------------------------------

_LIGHTNING_MODULES = tuple(f"{attn}.{o}" for attn in ("self_attn", "cross_attn") for o in "qkvo") + ("ffn.0", "ffn.2")
"""The layers of each block a Lightning adapter's keys name, in the original Wan names (diffusers' `attn1.to_q`,
`attn2.to_q`, ..., `ffn.net.0.proj`, `ffn.net.2`)."""


def lightning_layout_adapter(config: dict[str, Any], path: "str | os.PathLike", rank: int = 64, seed: int = 0,
                             std: float = 0.02) -> Path:
    """A random adapter for a transformer of `config` in the Lightning files' key layout (the original Wan
    names under `diffusion_model.`, `lora_down` / `lora_up` and an `alpha` per layer; every attention
    projection and both FFN layers of every block), of `rank`, written as safetensors. `alpha` is the
    rank (scale 1) and the values are `std`-scaled normal draws: choices for a random test adapter, not
    the release's."""
    import torch
    from safetensors.torch import save_file

    dim = config["num_attention_heads"] * config["attention_head_dim"]
    shapes = {f"{attn}.{o}": (dim, dim) for attn in ("self_attn", "cross_attn") for o in "qkvo"}
    shapes |= {"ffn.0": (config["ffn_dim"], dim), "ffn.2": (dim, config["ffn_dim"])}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(config["num_layers"]):
        for name in _LIGHTNING_MODULES:
            out, inp = shapes[name]
            key = f"diffusion_model.blocks.{i}.{name}"
            state[f"{key}.lora_down.weight"] = torch.randn(rank, inp, generator=g) * std
            state[f"{key}.lora_up.weight"] = torch.randn(out, rank, generator=g) * std
            state[f"{key}.alpha"] = torch.tensor(float(rank))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def tiny_release_checkpoint(name: str) -> Path:
    """The tiny checkpoint of release `name`'s layout (`FEW_STEP`): Lightning runs Wan 2.2's two experts."""
    if name not in FEW_STEP:
        raise ModelInputError(f"release {name!r} is not one of {', '.join(FEW_STEP)}")
    return tiny_checkpoint(experts=2)


def tiny_release_adapters(name: str, source: str) -> dict[str, Path]:
    """Random adapters of release `name`'s key layout and ranks for checkpoint `source` (its transformers'
    configs), by component, cached under `checkpoints.cache_dir()` by what they are built from."""
    import hashlib
    import json

    from tpupedia import files

    release = FEW_STEP[name]
    configs = component_configs(source)
    out: dict[str, Path] = {}
    for k, adapter in enumerate(release.adapters):
        config = checkpoints.clean_config(configs[adapter.component])
        spec = json.dumps([name, adapter.filename, adapter.rank, config, k], sort_keys=True, default=str)
        folder = checkpoints.cache_dir() / f"tiny-adapter-{name}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
        filename = Path(adapter.filename).name
        if not (folder / filename).is_file():
            files.directory_atomic(folder, lambda tmp, c=config, f=filename, r=adapter.rank, s=k:
                                   lightning_layout_adapter(c, tmp / f, r, seed=s))
        out[adapter.component] = folder / filename
    return out
