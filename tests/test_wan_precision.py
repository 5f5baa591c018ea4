"""Wan's precision and flow shift (notebook `wan_on_tpu`): a bf16 tiny run against stock in the same
precision, with a stated bound; `--shift` against stock's `UniPCMultistepScheduler.from_config(...,
flow_shift=...)`; bad shifts refused before anything loads; the components the run keeps in
float32 (`FLOAT32_COMPONENTS`, as diffusers' examples load them) are what it loads, what the plan
compiles and what the stage files record, and the plan lowers the VAE to the run's dtype only when
float32 does not fit."""

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
    way (`FLOAT32_COMPONENTS`, the VAE and the image encoder, in float32 on both sides): the frames within `BF16_MEAN_BOUND` on
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


def test_the_command_line_has_shift_and_solver_flags_for_wan(capsys):
    from tpupedia import cli

    args = cli.build_parser().parse_args(["generate", "wan", "--prompt", "x", "--shift", "5", "--solver", "euler"])
    assert (args.shift, args.solver) == (5.0, "euler")
    assert cli.main(["generate", "wan", "--preset", "tiny", "--prompt", "x", "--solver", "heun"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("solver='heun' is not one of unipc, euler")


def test_the_solver_is_in_the_denoise_settings_only_when_not_unipc():
    """Stage files made before the solver existed (UniPC) still match; an Euler run's do not match UniPC's."""
    configs = family.component_configs(str(family.tiny_checkpoint()))
    unipc, euler = (pipeline.settings("denoise", "tiny", configs, pipeline.Request(prompt="x", solver=s), dtype="float32")
                    for s in ("unipc", "euler"))
    assert "solver" not in unipc and euler.pop("solver") == "euler" and euler == unipc


def test_the_components_kept_in_float32_are_loaded_compiled_and_recorded_so(tmp_path):
    """bf16 (the full preset's dtype), Wan 2.1 I2V: the VAE and the CLIP tower run in float32 as
    diffusers' examples load them (`FLOAT32_COMPONENTS`): the image stage loads them in float32,
    its condition float32 and its features handed to the transformer in bf16
    (`image_embeds.to(transformer_dtype)`); the plan's VAE encode and decode programs and its CLIP
    program take float32 weights, as the run does; the stage files say so. A request with the VAE
    lowered (`vae_dtype="bfloat16"`, what the plan picks when float32 does not fit) compiles and
    records bf16 VAE weights, so a stage file of one is never read for the other."""
    assert family.FLOAT32_COMPONENTS == ("vae", "image_encoder")
    checkpoint = family.tiny_checkpoint(tmp_path / "i2v", image_to_video=True)
    configs = family.component_configs(str(checkpoint))
    request = pipeline.Request(prompt="a cat", frames=9, height=64, width=64, steps=2, seed=1,
                               image=_picture(tmp_path / "in.png", 40, 72))
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    pipe = pipeline.Wan(str(checkpoint), "tiny", torch.bfloat16, mesh, pipeline.Options(quiet=True), configs)
    pipe.resident = True  # keep what the stage loaded, to look at it
    out, _ = pipe.encode_image(request)
    assert pipe.held("image", ("vae", torch.float32), None).dtype == torch.float32
    assert pipe.held("image", "clip", None)[0].dtype == torch.float32
    assert out["condition"].dtype == torch.float32 and out["image_embeds"].dtype == torch.bfloat16

    plan = pipeline.Wan("(plan)", "plan", torch.bfloat16, mesh, pipeline.Options(), configs)
    plan.abstract = True
    lowered = pipeline.Wan.lowered(request, "bfloat16")
    assert lowered.vae_dtype == "bfloat16" and pipeline.Wan.lowered(lowered, "bfloat16") is None
    assert pipeline.Wan.lowered(request, "float32") is None  # a float32 run has nothing to lower
    for req, vae in ((request, "float32"), (lowered, "bfloat16")):
        programs = plan._image_programs(req) + plan._decode_programs(req)
        assert [p.component for p in programs] == ["image_encoder"] + ["vae"] * 6  # 3 encode chunks, 3 latent frames
        for program in programs:
            weights = [w for w in jax.tree.leaves(program.args[:2]) if jax.numpy.issubdtype(w.dtype, jax.numpy.floating)]
            want = "float32" if program.component == "image_encoder" else vae
            assert weights and {str(w.dtype) for w in weights} == {want}, program.name  # weights and buffers
        for stage in ("image", "decode"):
            assert _settings(checkpoint, req, stage, torch.bfloat16)["vae_dtype"] == vae
        assert _settings(checkpoint, req, "image", torch.bfloat16)["image_encoder_dtype"] == "float32"


def test_the_plan_keeps_the_vae_in_float32_unless_that_does_not_fit(checkpoint, monkeypatch):
    """Stock precision unless the plan shows it cannot fit: on CPU devices with the memory budget
    set between what the decode needs in float32 and in bf16, the plan lowers the VAE to the run's
    dtype, fits, and says why in a note; with room for float32 (this host's memory) it does not; `vae_dtype="float32"`
    (`--vae-dtype float32`) insists, and then the plan does not fit. The pre-run check hands the
    lowered request to the run and says so on every run, from its cache too."""
    from tpupedia import plan

    configs = family.component_configs(str(checkpoint))

    def planned(request, budget=None):
        if budget is not None:
            monkeypatch.setattr(plan, "memory_budget", lambda *a: (budget, "host memory per CPU device (test)"))
        return plan.make("wan", request, pipeline.Options(), configs=configs, layers=1, dtype="bfloat16",
                         run_devices=jax.devices(), stages=("decode",))

    stock = planned(REQUEST)  # this host's memory holds the float32 decode: stock precision, no note
    narrow = planned(dataclasses.replace(REQUEST, vae_dtype="bfloat16"))
    need32, need16 = stock.stage("decode").peak, narrow.stage("decode").peak
    assert stock.fits and stock.request.get("vae_dtype") is None and not any("VAE in" in n for n in stock.notes)
    assert narrow.request["vae_dtype"] == "bfloat16" and 0 < need16 < need32
    tight = planned(REQUEST, budget=(need16 + need32) / 2)
    assert tight.fits and tight.request["vae_dtype"] == "bfloat16" and tight.stage("decode").peak == need16
    assert any(n.startswith("VAE in bfloat16, not float32 as stock diffusers loads it: in float32 stage decode "
                            "needs") for n in tight.notes), tight.notes
    assert "VAE in bfloat16" in tight.summary().splitlines()[0]
    insist = planned(dataclasses.replace(REQUEST, vae_dtype="float32"), budget=(need16 + need32) / 2)
    assert not insist.fits and insist.request["vae_dtype"] == "float32" and "decode" in insist.advice()

    monkeypatch.setattr(plan, "make", lambda *a, **k: tight)
    lines: list[str] = []
    for _ in range(2):  # planned, then read from the cache: said both times
        got = plan.preflight("wan", REQUEST, pipeline.Options(), configs, jax.devices(), cache_dir=checkpoint / "plans",
                             dtype="bfloat16", log=lines.append)
        assert got.vae_dtype == "bfloat16"
    assert sum(line.startswith("plan: VAE in bfloat16, not float32") for line in lines) == 2, lines


@pytest.mark.parametrize("value", ["float16", "fp32", ""])
def test_a_vae_dtype_that_is_not_allowed_is_refused_before_loading(value):
    with pytest.raises(pipeline.PipelineError, match=f"vae_dtype={value!r} is not one of float32, bfloat16"):
        pipeline.validate(pipeline.Request(prompt="x", vae_dtype=value), pipeline.Options())


def test_the_command_line_has_a_vae_dtype_flag_for_wan_generate_and_plan():
    from tpupedia import cli

    assert cli.build_parser().parse_args(["generate", "wan", "--prompt", "x", "--vae-dtype", "bfloat16"]).vae_dtype \
        == "bfloat16"
    assert cli.build_parser().parse_args(["plan", "wan", "--vae-dtype", "float32"]).vae_dtype == "float32"
