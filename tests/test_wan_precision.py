"""Wan's precision and flow shift (notebook 11): a bf16 tiny run against stock in the same
precision, with a stated bound; `--shift` against stock's `UniPCMultistepScheduler.from_config(...,
flow_shift=...)`; bad shifts refused before anything loads; the components the run keeps in
float32 (`FLOAT32_COMPONENTS`) are what it loads, what the plan compiles and what the stage files
record."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from test_image_to_video import _picture

from tpupedia import devices, presets
from tpupedia.models import wan as family
from tpupedia.pipelines import schedulers, stages
from tpupedia.pipelines import wan as pipeline

TINY = presets.get("tiny")
REQUEST = pipeline.Request(prompt="a fox in the snow", negative_prompt="blurry", frames=9, height=64, width=48,
                           steps=4, guidance=5.0, seed=7, fps=8)
BF16_MEAN_BOUND = 0.02
"""Mean absolute difference of the frames (values in [0, 1]) between our bf16 run and stock's bf16
run. Both round the same weights to bf16 but in different orders of operations (XLA on 8 simulated
devices, the guidance pair as a batch, vs eager PyTorch), so the outputs differ by bf16 rounding
(relative 2^-8) at each of the 4 steps and in the decode; measured 4.0e-3 mean on the tiny
checkpoint (2.2e-3 with a float32 VAE on both sides): the bound leaves 5x."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return family.tiny_checkpoint(tmp_path_factory.mktemp("wan-precision"))


def _settings(checkpoint: Path, request: pipeline.Request, stage: str, dtype=torch.float32) -> dict:
    configs = family.component_configs(str(checkpoint))
    return pipeline.Wan.settings_for(str(checkpoint), configs, request, pipeline.Options(), dtype, stage)


def test_bfloat16_as_the_full_preset_runs_it(checkpoint, tmp_path):
    """A bf16 run (what the full preset runs) against stock `WanPipeline` loaded in bf16 the same
    way (`FLOAT32_COMPONENTS` in float32 on both sides): the frames within `BF16_MEAN_BOUND` on
    average, the text embeddings bf16, the latents float32 as stock keeps them."""
    options = pipeline.Options(quiet=True, dtype="bfloat16")
    pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), workdir=tmp_path, log=lambda _: None)
    read = lambda stage: stages.read(tmp_path, stage, _settings(checkpoint, REQUEST, stage, torch.bfloat16)).tensors  # noqa: E731
    assert read("text")["prompt_embeds"].dtype == torch.bfloat16
    latents, frames = read("denoise")["latents"], read("decode")["frames"]
    assert latents.dtype == frames.dtype == torch.float32 and torch.isfinite(frames).all()

    pipe, call = pipeline.stock(str(checkpoint), REQUEST, dtype=torch.bfloat16)
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.vae.dtype == getattr(torch, family.component_dtype("vae", "bfloat16"))
    with torch.no_grad():
        expected = torch.from_numpy(np.asarray(pipe(**call).frames[0], np.float32))
    assert frames.shape == expected.shape == (9, 64, 48, 3)
    mean_error, max_error = float((frames - expected).abs().mean()), float((frames - expected).abs().max())
    print(f"bf16 vs stock bf16: mean {mean_error:.2e}, max {max_error:.2e}")
    assert mean_error < BF16_MEAN_BOUND, mean_error
    assert frames.std() > 0.01


def test_a_shift_override_matches_stock_with_that_flow_shift(checkpoint, tmp_path):
    """`Request(shift=5.0)` (`--shift 5.0`) against stock `WanPipeline` with
    `UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0)`, float32: frames
    within 1e-4, on Wan 2.1's layout (one expert) at a size that is not square. The shift is in
    the denoise stage's settings, so the same request with the checkpoint's shift (3.0) does not
    reuse these latents."""
    request = dataclasses.replace(REQUEST, shift=5.0)
    pipe, call = pipeline.stock(str(checkpoint), request)
    assert pipe.scheduler.config.flow_shift == 5.0 and family.flow_shift(family.component_configs(str(checkpoint))) == 3.0
    expected = pipe(**call).frames[0]
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                 log=lambda _: None)
    frames = stages.read(tmp_path, "decode", _settings(checkpoint, request, "decode")).tensors["frames"].numpy()
    error = float(np.abs(frames - expected).max())
    print(f"shift 5.0: max abs error vs stock WanPipeline(flow_shift=5.0) {error:.2e}")
    assert frames.shape == expected.shape == (9, 64, 48, 3) and error <= 1e-4, error
    assert frames.std() > 0.01  # not a constant image that would match anything
    default = _settings(checkpoint, REQUEST, "denoise")
    assert default["shift"] == 3.0 and _settings(checkpoint, request, "denoise")["shift"] == 5.0
    with pytest.raises(stages.StageError, match="shift"):
        stages.read(tmp_path, "denoise", default)


def test_shift_reaches_the_unipc_tables():
    """The step's tables (sigmas, timesteps, solver coefficients) are those of stock's scheduler
    rebuilt with the shift, and of the checkpoint's `flow_shift` (3.0) without one."""
    from diffusers import UniPCMultistepScheduler

    configs = family.full_configs()
    pipe = pipeline.Wan("(none)", "test", torch.float32, devices.make_mesh((2, 4), ("dp", "tp")),
                        pipeline.Options(), configs)
    for shift, want in ((None, 3.0), (5.0, 5.0)):
        tables = pipe._denoise_setup(pipeline.Request(prompt="x", frames=5, height=64, width=64, steps=6, shift=shift)).tables
        stock = UniPCMultistepScheduler.from_config(configs["scheduler"], flow_shift=want)
        stock.set_timesteps(6)
        expected = schedulers.unipc_tables(stock)
        assert set(tables) == set(expected)
        for name, values in expected.items():
            np.testing.assert_array_equal(np.asarray(tables[name]), values, err_msg=f"shift {shift}: {name}")


@pytest.mark.parametrize("shift", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_bad_shift_is_refused_before_loading(shift):
    with pytest.raises(pipeline.PipelineError, match=f"shift={shift} must be a finite number > 0"):
        pipeline.validate(pipeline.Request(prompt="x", shift=shift), pipeline.Options())


def test_the_command_line_has_a_shift_flag_for_wan():
    from tpupedia import cli

    args = cli.build_parser().parse_args(["generate", "wan", "--prompt", "x", "--shift", "5"])
    assert args.shift == 5.0


def test_the_components_kept_in_float32_are_loaded_compiled_and_recorded_so(tmp_path, monkeypatch):
    """bf16 (the full preset's dtype), Wan 2.1 I2V, with the VAE and the CLIP tower named in
    `FLOAT32_COMPONENTS` (diffusers' examples' precision; empty for now, see its docstring): the
    image stage loads them in float32, its condition float32 and its features handed to the
    transformer in bf16 (`image_embeds.to(transformer_dtype)`); the plan's VAE encode and decode
    programs and its CLIP program take float32 weights, as the run does; the stage files say so."""
    monkeypatch.setattr(family, "FLOAT32_COMPONENTS", ("vae", "image_encoder"))
    checkpoint = family.tiny_checkpoint(tmp_path / "i2v", image_to_video=True)
    configs = family.component_configs(str(checkpoint))
    request = pipeline.Request(prompt="a cat", frames=9, height=64, width=64, steps=2, seed=1,
                               image=_picture(tmp_path / "in.png", 40, 72))
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    pipe = pipeline.Wan(str(checkpoint), "tiny", torch.bfloat16, mesh, pipeline.Options(quiet=True), configs)
    pipe.resident = True  # keep what the stage loaded, to look at it
    out, _ = pipe.encode_image(request)
    assert pipe.held("image", "vae", None).dtype == torch.float32
    assert pipe.held("image", "clip", None)[0].dtype == torch.float32
    assert out["condition"].dtype == torch.float32 and out["image_embeds"].dtype == torch.bfloat16

    plan = pipeline.Wan("(plan)", "plan", torch.bfloat16, mesh, pipeline.Options(), configs)
    plan.abstract = True
    programs = plan._image_programs(request) + plan._decode_programs(request)
    assert [p.component for p in programs] == ["image_encoder"] + ["vae"] * 6  # 3 encode chunks, 3 latent frames
    for program in programs:
        weights = [w for w in jax.tree.leaves(program.args[:2]) if jax.numpy.issubdtype(w.dtype, jax.numpy.floating)]
        assert weights and {str(w.dtype) for w in weights} == {"float32"}, program.name  # weights and buffers
    for stage in ("image", "decode"):
        assert _settings(checkpoint, request, stage, torch.bfloat16)["vae_dtype"] == "float32"
    assert _settings(checkpoint, request, "image", torch.bfloat16)["image_encoder_dtype"] == "float32"
