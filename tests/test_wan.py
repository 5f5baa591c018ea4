"""Wan 2.1 / 2.2 (notebook `wan_on_tpu`): UniPC as a pure step equal to the stock scheduler step by step,
parity of the whole pipeline with stock `WanPipeline` for two experts and for the TI2V
layout (expanded timesteps, the residual VAE), shape facts from the checkpoint, refusals before
any model loads, and the command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tpupedia import families, presets
from tpupedia.models import ModelInputError
from tpupedia.models import wan as family
from tpupedia.pipelines import schedulers, stages
from tpupedia.pipelines import wan as pipeline

TINY = presets.get("tiny")
REQUEST = pipeline.Request(prompt="a fox in the snow", negative_prompt="blurry", frames=9, height=64, width=48,
                           steps=4, guidance=5.0, seed=7, fps=8)


def _unipc(**overrides):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**(family.SCHEDULER_CONFIG | overrides))


@pytest.mark.parametrize("steps, overrides", [
    (12, {}), (7, {"flow_shift": 5.0}), (3, {"solver_order": 1}), (2, {"flow_shift": 12.0}), (1, {}),
    (6, {"solver_type": "bh1"}), (5, {"disable_corrector": [1, 2]}), (4, {"lower_order_final": False, "flow_shift": 1.0}),
])
def test_unipc_step_equals_the_stock_step_at_every_step(steps, overrides):
    """The pure step, jitted once, against `UniPCMultistepScheduler.step` fed the same outputs:
    float32 rounding apart (values of order 1-10), at every step, for Wan's configuration and its
    variants (first order, bh1, a disabled corrector, no lower-order final step)."""
    import jax
    import jax.numpy as jnp

    stock = _unipc(**overrides)
    stock.set_timesteps(steps)
    tables = {k: jnp.asarray(v) for k, v in schedulers.unipc_tables(stock).items()}
    step = jax.jit(schedulers.unipc_step)
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 3, 5, 6, generator=g)
    ours, state = jnp.asarray(sample.numpy()), schedulers.unipc_state(tuple(sample.shape))
    for i, t in enumerate(stock.timesteps):
        output = torch.randn(sample.shape, generator=g)
        sample = stock.step(output, t, sample, return_dict=False)[0]
        ours, state = step(tables, i, ours, jnp.asarray(output.numpy()), state)
        np.testing.assert_allclose(np.asarray(ours), sample.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"step {i}")


def test_unipc_tables_refuse_what_the_pure_step_does_not_reproduce():
    for overrides, message in (({"prediction_type": "epsilon", "use_flow_sigmas": False}, "prediction_type='epsilon'"),
                               ({"solver_order": 3}, "solver_order=3")):
        scheduler = _unipc(**overrides)
        scheduler.set_timesteps(4)
        with pytest.raises(schedulers.SchedulerError, match=message):
            schedulers.unipc_tables(scheduler)
    with pytest.raises(schedulers.SchedulerError, match="set_timesteps"):
        schedulers.unipc_tables(_unipc())


@pytest.fixture(scope="module", params=[1, 2], ids=["wan2.1", "wan2.2-two-experts"])
def checkpoint(request, tmp_path_factory) -> Path:
    return family.tiny_checkpoint(tmp_path_factory.mktemp(f"wan-{request.param}"), experts=request.param)


def _stock_frames(checkpoint: Path, request: pipeline.Request) -> np.ndarray:
    pipe, call = pipeline.stock(str(checkpoint), request)
    return pipe(**call).frames[0]


@pytest.mark.parametrize("checkpoint", [2], ids=["wan2.2-two-experts"], indirect=True)
def test_frames_match_stock_wan_pipeline(checkpoint, tmp_path):
    """Same weights, same seed: stock `WanPipeline(output_type="np")` frames within 1e-4 (fp32),
    for Wan 2.2's two experts (a boundary inside the 4 steps, and a second guidance scale, so both
    experts and both scales are used). Wan 2.1 (one expert) at this request is
    test_wan_precision.py's shift parity, and at the checkpoint's shift notebook `wan_on_tpu`'s asserts."""
    configs = family.component_configs(str(checkpoint))
    two = len(family.experts(configs)) == 2
    request = pipeline.Request(**{**REQUEST.__dict__, "guidance_2": 3.0 if two else None})
    expected = _stock_frames(checkpoint, request)
    reports = pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                           log=lambda _: None)
    denoise = {r.stage: r for r in reports}["denoise"].timings
    if two:
        assert set(denoise["steps_per_expert"].values()) != {0} and sum(denoise["steps_per_expert"].values()) == 4
    settings = pipeline.Wan.settings_for(str(checkpoint), configs, request, pipeline.Options(), torch.float32, "decode")
    frames = stages.read(tmp_path, "decode", settings).tensors["frames"].numpy()
    assert frames.shape == expected.shape == (9, 64, 48, 3)
    error = float(np.abs(frames - expected).max())
    print(f"{'Wan 2.2' if two else 'Wan 2.1'}: max abs error vs stock WanPipeline {error:.2e}")
    assert error <= 1e-4, error
    assert frames.std() > 0.01


def test_ti2v_expanded_timesteps_match_stock_wan_pipeline(tmp_path):
    """Wan 2.2 TI2V-5B's layout: `expand_timesteps` (a timestep per latent token) and its VAE
    (residual blocks, 2x2 pixel patches, 16x in space, read from the VAE's config). Same weights
    and seed as stock `WanPipeline(output_type="np")`: frames within 1e-4 (fp32), at a size that
    is not square."""
    ckpt = family.tiny_checkpoint(tmp_path / "ti2v", vae=family.TI2V_VAE, expand_timesteps=True)
    configs = family.component_configs(str(ckpt))
    assert configs["pipeline"]["expand_timesteps"] and family.shape_facts(configs).spatial == 16
    request = pipeline.Request(**{**REQUEST.__dict__, "width": 96, "steps": 3})
    expected = _stock_frames(ckpt, request)
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(ckpt), workdir=tmp_path / "w",
                 log=lambda _: None)
    settings = pipeline.Wan.settings_for(str(ckpt), configs, request, pipeline.Options(), torch.float32, "decode")
    frames = stages.read(tmp_path / "w", "decode", settings).tensors["frames"].numpy()
    assert frames.shape == expected.shape == (9, 64, 96, 3)
    error = float(np.abs(frames - expected).max())
    print(f"Wan 2.2 TI2V layout: max abs error vs stock WanPipeline {error:.2e}")
    assert error <= 1e-4, error
    assert frames.std() > 0.01


def test_shape_facts_come_from_the_checkpoint(tmp_path):
    """A checkpoint whose transformer patches 1x1 (not 2x2) accepts sizes in multiples of 8 and
    refuses 4n+2 frames, all from its configs; the release's facts stay the default."""
    ckpt = family.tiny_checkpoint(tmp_path / "patch1", transformer={"patch_size": (1, 1, 1)})
    facts = family.shape_facts(family.component_configs(str(ckpt)))
    assert (facts.spatial, facts.temporal, facts.patch, facts.latent_channels) == (8, 4, 1, 4)
    assert family.DEFAULT_SHAPES.size_multiple == 16 and facts.size_multiple == 8
    configs = family.component_configs(str(ckpt))
    pipeline.validate(pipeline.Request(prompt="x", frames=5, height=40, width=56), pipeline.Options(), configs=configs)
    with pytest.raises(ModelInputError, match="multiples of 16"):
        pipeline.validate(pipeline.Request(prompt="x", frames=5, height=40, width=56), pipeline.Options())
    with pytest.raises(ModelInputError, match=r"frames=6: Wan generates 4n\+1 frames.*round 6 down to 5"):
        pipeline.validate(pipeline.Request(prompt="x", frames=6, height=64, width=64), pipeline.Options(), configs=configs)


def test_a_second_guidance_needs_a_second_expert(checkpoint):
    configs = family.component_configs(str(checkpoint))
    request = pipeline.Request(prompt="x", frames=9, height=64, width=64, guidance_2=3.0)
    if len(family.experts(configs)) == 2:
        pipeline.validate(request, pipeline.Options(), configs=configs)
    else:  # as stock WanPipeline refuses guidance_scale_2 without a boundary
        with pytest.raises(pipeline.PipelineError, match="guidance_2=3.0: this checkpoint has one transformer"):
            pipeline.validate(request, pipeline.Options(), configs=configs)


def test_bad_requests_are_refused_before_loading():
    for request, message in ((pipeline.Request(prompt="x", guidance_2=float("nan")), "guidance_2=nan"),
                             (pipeline.Request(prompt="x", vae_tiling=True), "vae_tiling=on"),
                             (pipeline.Request(prompt=" "), "the prompt is empty")):
        with pytest.raises(pipeline.PipelineError, match=message):
            pipeline.validate(request, pipeline.Options())


def test_the_registry_knows_wan_and_its_two_experts():
    spec = families.get("wan", "video")
    assert spec.facts is family and spec.pipeline == "tpupedia.pipelines.wan"
    assert family.experts(family.full_configs()) == ("transformer",)
    two = family.full_configs(experts=2)
    assert family.experts(two) == ("transformer", "transformer_2") and family.boundary_timestep(two) == 875.0
    flops = family.step_flops(1280, 720, 81)
    assert flops["tokens"] == 21 * 45 * 80  # 75,600 video tokens per sample at 720p, 81 frames


def test_generate_wan_writes_a_video(tmp_path, run_cli):
    # the claim is a file, not a video: one step, one frame, the smallest size (faster to make)
    done = run_cli("generate", "wan", "--preset", "tiny", "--prompt", "a fox", "--out", "fox.mp4", "--workdir", "w",
                   "--steps", "1", "--frames", "1", "--height", "16", "--width", "16", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "fox.mp4").stat().st_size > 1000
    refused = run_cli("generate", "wan", "--preset", "tiny", "--prompt", "a fox", "--frames", "8", cwd=tmp_path)
    assert refused.returncode == 2 and "frames=8: Wan generates 4n+1 frames" in refused.stderr
