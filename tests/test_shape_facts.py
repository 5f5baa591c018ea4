"""Shape facts come from the checkpoint's configs, as diffusers reads them (`tpupedia.models.shapes`).

A checkpoint whose VAE compresses 4x in space (3 blocks) or 2x in time, or whose transformer has
another patch size, must give the frames the stock pipeline gives for the same weights and seed:
the frame and size rules, the latent shapes, the RoPE grid and the decode all follow its configs.
The module constants stay the released checkpoints' defaults."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tpupedia import presets
from tpupedia.errors import TpupediaError
from tpupedia.models import cogvideox, hunyuan
from tpupedia.models.shapes import ShapeFacts
from tpupedia.pipelines import cogvideox as cog_pipeline
from tpupedia.pipelines import hunyuan as hy_pipeline
from tpupedia.pipelines import stages

TINY = presets.get("tiny")

# CogVideoX with a 3-block VAE (4x in space), 2x in time and 1x1 patches: sizes in multiples of 4,
# frames 2n+1, neither allowed by the released checkpoint's rules (16 and 4n+1).
COG_VAE = dict(block_out_channels=(8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 3,
               up_block_types=("CogVideoXUpBlock3D",) * 3, temporal_compression_ratio=2)
COG_TRANSFORMER = dict(patch_size=1, sample_height=6, sample_width=10, sample_frames=7)
COG_REQUEST = cog_pipeline.Request(prompt="a fox in the snow", negative_prompt="blurry", frames=7, height=24,
                                   width=40, steps=3, guidance=6.0, seed=5, fps=8)
# HunyuanVideo-1.5 with a 4-block VAE (8x in space) that compresses 2x in time: frames 2n+1, sizes in 8s.
HY_VAE = dict(block_out_channels=(8, 8, 8, 8), spatial_compression_ratio=8, temporal_compression_ratio=2)
HY_REQUEST = hy_pipeline.Request(prompt="a fox in the snow", negative_prompt="blurry", frames=7, height=40, width=24,
                                 steps=3, seed=5, fps=8)


@pytest.fixture(scope="module")
def cog_checkpoint(tmp_path_factory) -> Path:
    return cogvideox.tiny_checkpoint(tmp_path_factory.mktemp("cog-4x"), scheduler="ddim", vae=COG_VAE,
                                     transformer=COG_TRANSFORMER)


@pytest.fixture(scope="module")
def hy_checkpoint(tmp_path_factory) -> Path:
    return hunyuan.tiny_checkpoint(tmp_path_factory.mktemp("hy-2x"), vae=HY_VAE)


def test_facts_are_read_from_the_configs_as_diffusers_reads_them(cog_checkpoint, hy_checkpoint):
    from diffusers import CogVideoXPipeline, HunyuanVideo15Pipeline

    cog = cogvideox.shape_facts(cogvideox.component_configs(str(cog_checkpoint)))
    stock = CogVideoXPipeline.from_pretrained(cog_checkpoint, use_safetensors=True)
    assert cog == ShapeFacts(spatial=stock.vae_scale_factor_spatial, temporal=stock.vae_scale_factor_temporal,
                             patch=stock.transformer.config.patch_size, patch_t=stock.transformer.config.patch_size_t,
                             latent_channels=stock.transformer.config.in_channels) == ShapeFacts(4, 2, 1, 2, 4)
    hy = hunyuan.shape_facts(hunyuan.component_configs(str(hy_checkpoint)))
    stock = HunyuanVideo15Pipeline.from_pretrained(hy_checkpoint, use_safetensors=True)
    assert hy == ShapeFacts(spatial=stock.vae_scale_factor_spatial, temporal=stock.vae_scale_factor_temporal,
                            patch=stock.transformer.config.patch_size, patch_t=stock.transformer.config.patch_size_t,
                            latent_channels=stock.num_channels_latents) == ShapeFacts(8, 2, 1, 1, 4)
    # the defaults are the released checkpoints' facts, and the tiny presets share them
    assert cogvideox.DEFAULT_SHAPES == ShapeFacts(8, 4, 2, 2, 16) and hunyuan.DEFAULT_SHAPES == ShapeFacts(16, 4, 1, 1, 32)
    tiny_cog = cogvideox.shape_facts({"vae": cogvideox.tiny_vae_config(), "transformer": cogvideox.tiny_transformer_config()})
    assert (tiny_cog.spatial, tiny_cog.temporal, tiny_cog.patch, tiny_cog.patch_t) == (8, 4, 2, 2)


def test_the_rules_follow_the_checkpoint(cog_checkpoint, hy_checkpoint):
    """7 frames and 24x40 are refused under the released checkpoints' rules, allowed for these."""
    for family, pipeline, checkpoint, request in ((cogvideox, cog_pipeline, cog_checkpoint, COG_REQUEST),
                                                  (hunyuan, hy_pipeline, hy_checkpoint, HY_REQUEST)):
        with pytest.raises(TpupediaError, match="frames=7"):
            pipeline.validate(request, pipeline.Options())
        configs = family.component_configs(str(checkpoint))
        pipeline.validate(request, pipeline.Options(), configs=configs)
        with pytest.raises(TpupediaError, match="frames=8: .* 2n\\+1"):
            pipeline.validate(type(request)(**{**request.__dict__, "frames": 8}), pipeline.Options(), configs=configs)
    with pytest.raises(TpupediaError, match="multiples of 4"):
        cog_pipeline.validate(cog_pipeline.Request(**{**COG_REQUEST.__dict__, "width": 42}), cog_pipeline.Options(),
                              configs=cogvideox.component_configs(str(cog_checkpoint)))


def test_cogvideox_with_a_4x_vae_and_1x1_patches_matches_stock(cog_checkpoint, tmp_path):
    from diffusers import CogVideoXPipeline

    pipe = CogVideoXPipeline.from_pretrained(cog_checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    r = COG_REQUEST
    expected = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.frames, height=r.height,
                    width=r.width, num_inference_steps=r.steps, guidance_scale=r.guidance, output_type="np",
                    generator=torch.Generator().manual_seed(r.seed),
                    max_sequence_length=pipe.transformer.config.max_text_seq_length).frames[0]
    for vae in ("flax", "torchax"):
        cog_pipeline.run(r, cog_pipeline.Options(quiet=True, vae=vae), preset=TINY, model=str(cog_checkpoint),
                         workdir=tmp_path / vae, log=lambda _: None)
        settings = cog_pipeline.settings("decode", str(cog_checkpoint), cogvideox.component_configs(str(cog_checkpoint)),
                                         r, vae=vae)
        frames = stages.read(tmp_path / vae, "decode", settings).tensors["frames"].numpy()
        # CogVideoX's decoder batches latent frames in twos, so with 2x time compression it returns
        # 8 frames for 4 latent frames (diffusers 0.42.1): the stock pipeline's count is the reference.
        assert frames.shape == expected.shape == (8, 24, 40, 3), (vae, frames.shape, expected.shape)
        error = float(np.abs(frames - expected).max())
        assert error <= 1e-4 and frames.std() > 0.01, (vae, error)


def test_hunyuan_with_a_2x_temporal_vae_matches_stock(hy_checkpoint, tmp_path):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(hy_checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    r = HY_REQUEST
    expected = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.frames, height=r.height,
                    width=r.width, num_inference_steps=r.steps, output_type="np",
                    generator=torch.Generator().manual_seed(r.seed)).frames[0]
    hy_pipeline.run(r, hy_pipeline.Options(quiet=True), preset=TINY, model=str(hy_checkpoint), workdir=tmp_path,
                    log=lambda _: None)
    settings = hy_pipeline.Hunyuan.settings_for(str(hy_checkpoint), hunyuan.component_configs(str(hy_checkpoint)), r,
                                                hy_pipeline.Options(), torch.float32, "decode")
    frames = stages.read(tmp_path, "decode", settings).tensors["frames"].numpy()
    assert frames.shape == expected.shape == (7, 40, 24, 3), (frames.shape, expected.shape)
    error = float(np.abs(frames - expected).max())
    assert error <= 1e-4 and frames.std() > 0.01, error
