"""The CogVideoX pipeline (notebook `cogvideox_pipeline`): parity with stock diffusers, one compile for all
steps, stage files that resume and refuse, bad input refused before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tpupedia import presets
from tpupedia.errors import TpupediaError
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import cogvideox as pipeline
from tpupedia.pipelines import stages

TINY = presets.get("tiny")
REQUEST = pipeline.Request(prompt="a panda playing a guitar", negative_prompt="blurry", frames=9, height=32,
                           width=32, steps=4, guidance=6.0, seed=3, fps=8)


def _stock_frames(checkpoint: Path, request: pipeline.Request) -> np.ndarray:
    pipe, call = pipeline.stock(str(checkpoint), request)
    return pipe(**call).frames[0]


def _stock_frames_tiled_and_untiled(source: str, stock, request) -> tuple[np.ndarray, np.ndarray]:
    """Stock diffusers' frames for `request` (its VAE tiling on), and the same run's latents
    decoded again by stock's VAE with tiling off: one stock run for both sides of the seams."""
    pipe, call = stock(source, request)
    assert request.vae_tiling and pipe.vae.use_tiling
    decode, seen = pipe.vae.decode, []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return decode(*args, **kwargs)

    pipe.vae.decode = spy
    tiled = pipe(**call).frames[0]
    assert len(seen) == 1
    pipe.vae.disable_tiling()
    with torch.no_grad():
        video = decode(*seen[0][0], **seen[0][1])
    video = video[0] if isinstance(video, tuple) else video.sample
    return tiled, pipe.video_processor.postprocess_video(video, output_type="np")[0]


@pytest.fixture(scope="module", params=[("ddim", 2), ("ddim", None)], ids=["1.5-ddim", "1.0-ddim"])
def checkpoint(request, tmp_path_factory) -> Path:
    """Tiny checkpoints in the CogVideoX 1.5 layout (patch_size_t=2) and the 1.0 layout (none), with
    DDIM. The default checkpoint (1.5 layout, DPM) is notebook `cogvideox_pipeline`'s: its asserts prove that parity."""
    scheduler, patch_size_t = request.param
    return family.tiny_checkpoint(tmp_path_factory.mktemp(f"ckpt-{scheduler}-{patch_size_t}"), scheduler=scheduler,
                                  patch_size_t=patch_size_t)


def test_frames_match_stock_diffusers(checkpoint, tmp_path):
    """Same weights, same seed: the staged torchax pipeline gives stock diffusers' frames (fp32, 1e-4)."""
    expected = _stock_frames(checkpoint, REQUEST)
    reports = pipeline.run(REQUEST, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint),
                           workdir=tmp_path, log=lambda _: None)
    assert [r.stage for r in reports] == ["text", "denoise", "decode"] and all(r.ran for r in reports)
    frames = stages.read(tmp_path, "decode", _settings(checkpoint, "decode")).tensors["frames"].numpy()
    assert frames.dtype == np.float32 and frames.shape == expected.shape == (9, 32, 32, 3)
    error = float(np.abs(frames - expected).max())
    print(f"max abs error vs stock diffusers: {error:.2e}")
    assert error <= 1e-4, error
    assert frames.std() > 0.01  # not a constant image that would match anything


def test_dynamic_guidance_frames_match_stock_diffusers_with_use_dynamic_cfg(tmp_path):
    """`--dynamic-cfg on` is stock's `use_dynamic_cfg=True` (the CogVideoX authors' sampling, with
    the DPM scheduler of the default tiny checkpoint): each step's scale from its timestep, the
    frames stock's (fp32, 1e-4) and not those of the constant scale."""
    import dataclasses

    checkpoint = family.tiny_checkpoint()  # DPM, the 1.5 layout
    request = dataclasses.replace(REQUEST, dynamic_cfg=True)
    scales = [family.dynamic_guidance(6.0, 4, t) for t in (999, 749, 499, 249)]
    assert min(scales) >= 1.0 and max(scales) <= 7.0 and len({round(g, 6) for g in scales}) > 1
    expected, constant = _stock_frames(checkpoint, request), _stock_frames(checkpoint, REQUEST)
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                 log=lambda _: None)
    settings = _settings(checkpoint, "decode", request)
    assert settings["dynamic_cfg"] is True and "dynamic_cfg" not in _settings(checkpoint, "decode")
    frames = stages.read(tmp_path, "decode", settings).tensors["frames"].numpy()
    error = float(np.abs(frames - expected).max())
    assert error <= 1e-4, error
    assert float(np.abs(expected - constant).max()) > 100 * max(error, 1e-6)  # the scale schedule changed the video


def test_tiled_frames_match_stock_diffusers_tiled(tmp_path):
    """`vae_tiling` on both sides: stock diffusers' `vae.enable_tiling()` and the Flax NNX VAE's tiles
    give the same frames (fp32, 1e-4). The VAE's tiles (half its `sample_height/width`: 48x40 pixels
    here) split the 64x96 video both ways (2 x 3 tiles), so tiling really changes pixels: stock's VAE
    decoding the same latents untiled differs. Tiles are spatial, so one step is enough."""
    import dataclasses

    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt", vae={"sample_height": 96, "sample_width": 80},
                                        transformer={"sample_height": 8, "sample_width": 12})  # RoPE grid 8x12 latents
    request = dataclasses.replace(REQUEST, height=64, width=96, steps=1, vae_tiling=True)
    expected, untiled = _stock_frames_tiled_and_untiled(str(checkpoint), pipeline.stock, request)
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path / "w",
                 log=lambda _: None)
    frames = stages.read(tmp_path / "w", "decode", _settings(checkpoint, "decode", request)).tensors["frames"].numpy()
    assert frames.shape == expected.shape == untiled.shape == (9, 64, 96, 3)
    error = float(np.abs(frames - expected).max())
    assert error <= 1e-4, error
    assert float(np.abs(untiled - expected).max()) > 1e-3  # the seams are real: tiled is not untiled


def _settings(checkpoint: Path, stage: str, request: pipeline.Request = REQUEST, vae: str = "flax",
              dtype: str = "float32") -> dict:
    return pipeline.settings(stage, str(checkpoint), family.component_configs(str(checkpoint)), request, vae=vae,
                             dtype=dtype)


def test_one_compile_for_all_steps_and_stages_resume(tmp_path, monkeypatch):
    """The denoising step is traced once for all steps; finished stages are skipped; --force reruns."""
    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt")
    traces = []
    real = pipeline.CogVideoX.denoise

    def counting(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        traces.append(self.traces["denoise"])
        return out

    monkeypatch.setattr(pipeline.CogVideoX, "denoise", counting)
    options = pipeline.Options(quiet=True)
    first = pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), workdir=tmp_path / "w", log=lambda _: None)
    assert traces == [1]  # one trace of the step for REQUEST.steps == 4 steps
    again = pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), workdir=tmp_path / "w", log=lambda _: None)
    assert [r.ran for r in again] == [False, False, False]
    forced = pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), stage="decode", force=True,
                          workdir=tmp_path / "w", log=lambda _: None)
    assert [(r.stage, r.ran) for r in forced] == [("decode", True)]
    timings = stages.read(tmp_path / "w", "denoise", _settings(checkpoint, "denoise")).meta["extra"]["timings"]
    assert timings["steps"] == 4 and timings["first_s"] > 0 and timings["steady_s"] > 0
    assert first[1].timings["padding_frames"] == 1  # 9 frames -> 3 latent frames, padded to 4 for patch_size_t=2


def test_a_stage_refuses_input_made_for_another_request(tmp_path):
    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt")
    options = pipeline.Options(quiet=True)
    pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), stage="text", workdir=tmp_path, log=lambda _: None)
    other = pipeline.Request(**{**REQUEST.__dict__, "prompt": "a cat on a skateboard"})
    with pytest.raises(stages.StageError, match="prompt") as err:
        pipeline.run(other, options, preset=TINY, model=str(checkpoint), stage="denoise", workdir=tmp_path,
                     log=lambda _: None)
    assert "a cat on a skateboard" in str(err.value) and REQUEST.prompt in str(err.value)
    with pytest.raises(stages.StageError, match="denoise"):  # decode before denoise ran
        pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), stage="decode", workdir=tmp_path,
                     log=lambda _: None)


@pytest.mark.parametrize("change, message", [
    ({"prompt": "  "}, "prompt is empty"),
    ({"frames": 10}, "frames=10"),
    ({"height": 40}, "32x40"),
    ({"steps": 0}, "steps=0"),
    ({"guidance": float("nan")}, "guidance=nan"),
])
def test_bad_requests_are_refused_before_any_model_loads(change, message, monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the request was validated")

    monkeypatch.setattr(family, "model_source", no_loading)
    request = pipeline.Request(**{**REQUEST.__dict__, **change})
    with pytest.raises(TpupediaError, match=message):
        pipeline.run(request, pipeline.Options(), preset=TINY, workdir=tmp_path, log=lambda _: None)


def test_mesh_must_match_the_devices(monkeypatch, tmp_path):
    monkeypatch.setattr(family, "model_source", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(pipeline.PipelineError, match="needs 9 devices, but 8 are available"):
        pipeline.run(REQUEST, pipeline.Options(mesh=(3, 3)), preset=TINY, workdir=tmp_path, log=lambda _: None)
    for text in ("dp=2", "dp=2,tp=x", "dp=2,sp=4", "dp=0,tp=8"):
        with pytest.raises(pipeline.PipelineError, match="mesh"):
            pipeline.parse_mesh(text)
    assert pipeline.parse_mesh("dp=2,tp=4") == (2, 4)


def test_cli_generates_a_video_and_refuses_bad_frames_in_one_line(tmp_path, run_cli):
    # the claim is a file, not a video: one step, one frame, the smallest size (faster to make)
    done = run_cli("generate", "cogvideox", "--preset", "tiny", "--prompt", "a panda", "--out", "panda.mp4",
                   "--workdir", "w", "--steps", "1", "--frames", "1", "--height", "16", "--width", "16", "--quiet",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    video = tmp_path / "panda.mp4"
    assert video.stat().st_size > 1000 and video.read_bytes()[4:8] == b"ftyp"  # an ISO-BMFF (mp4) file
    bad = run_cli("generate", "cogvideox", "--preset", "tiny", "--prompt", "a panda", "--frames", "10", cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "frames=10" in lines[0] and "Traceback" not in bad.stderr


def test_bfloat16_as_the_full_preset_runs_it(tmp_path):
    """The released checkpoints run in bf16: the same code path, every stage, on the tiny model."""
    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt")
    options = pipeline.Options(quiet=True, dtype="bfloat16", vae="torchax")
    pipeline.run(REQUEST, options, preset=TINY, model=str(checkpoint), workdir=tmp_path / "w", log=lambda _: None)
    text = stages.read(tmp_path / "w", "text", _settings(checkpoint, "text", dtype="bfloat16"))
    latents = stages.read(tmp_path / "w", "denoise", _settings(checkpoint, "denoise", dtype="bfloat16"))
    frames = stages.read(tmp_path / "w", "decode", _settings(checkpoint, "decode", vae="torchax", dtype="bfloat16"))
    assert text.tensors["prompt_embeds"].dtype == latents.tensors["latents"].dtype == torch.bfloat16
    frames = frames.tensors["frames"]
    assert frames.dtype == torch.float32 and frames.shape == (9, 32, 32, 3) and torch.isfinite(frames).all()
    expected = _stock_frames_bf16(checkpoint)
    assert float((frames - torch.from_numpy(expected)).abs().mean()) < 0.05  # bf16: close on average, not bitwise


def _stock_frames_bf16(checkpoint: Path) -> np.ndarray:
    pipe, call = pipeline.stock(str(checkpoint), REQUEST, dtype=torch.bfloat16)
    with torch.no_grad():
        return pipe(**call).frames[0]


def test_bench_generate_records_per_stage_timings(tmp_path):
    from tpupedia import bench, results

    record = bench.bench_generate("cogvideox", TINY, REQUEST, pipeline.Options(quiet=True))
    assert record["bench"] == "generate-cogvideox" and set(record["stages"]) == {"text", "denoise", "decode"}
    assert record["stages"]["denoise"]["steps"] == REQUEST.steps and record["total_s"] > 0
    assert record["config"]["attention"] == "reference"  # what `auto` meant on this CPU
    assert record["config"]["mesh"] == "dp=2,tp=4"  # the guidance pair on dp, 8 simulated devices
    stock = record["stock"]  # the stock pipeline, same request and checkpoint, in the same run
    assert stock["steps"] == REQUEST.steps and len(stock["step_s"]) == REQUEST.steps and stock["steady_s"] > 0
    assert record["ratio_step_over_stock"] == pytest.approx(record["stages"]["denoise"]["steady_s"] / stock["steady_s"])
    path = bench.merge_record(record, tmp_path / "pipelines.json", key=bench._pipeline_key)
    bench.merge_record(record, path, key=bench._pipeline_key)  # the same run again replaces its row
    assert len(results.load(path)) == 1


@pytest.mark.parametrize("args, names", [
    (["--model", "{tmp}/no-such-folder"], ["no-such-folder", "no such folder"]),
    (["--model", "{tmp}"], ["model_index.json", "not a diffusers"]),
    (["--model", "nobody/NoSuchModel"], ["nobody/NoSuchModel", "HF_HUB_OFFLINE=1"]),
    (["--model", "{tmp}/half"], ["half", "transformer config"]),
    (["--preset", "tiny", "--workdir", "{tmp}/a-file/stages"], ["a-file/stages", "cannot be created"]),
    (["--preset", "tiny", "--seed", str(2**64)], [f"seed={2**64}", "2^64"]),
    (["--preset", "tiny", "--seed", "-1"], ["seed=-1"]),
    (["--preset", "tiny", "--block-sizes", "100,128,128"], ["block_q=100", "multiple of 128"]),
    (["--preset", "tiny", "--block-sizes", "256,256,512"], ["block_kv_compute=512", "divide block_kv=256"]),
    (["--preset", "tiny", "--block-sizes", "3328x2816"], ["3328x2816", "BLOCK_Q,BLOCK_KV,BLOCK_KV_COMPUTE"]),
    (["--preset", "tiny", "--mesh", "dp=4,tp=2"], ["dp=4", "dp=1 or dp=2"]),
    (["--preset", "tiny", "--mesh", "dp=2,tp=4", "--guidance", "1"], ["dp=2", "guidance off", "dp=1"]),
])
def test_bad_command_lines_get_one_line_naming_the_value_before_anything_loads(args, names, tmp_path, capsys,
                                                                               monkeypatch):
    """Tried as a new user would: each ends in one line on stderr and exit 2, with no model built
    (the tiny checkpoint is never written) and JAX never started."""
    from tpupedia import cli, devices

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(family, "tiny_checkpoint", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda *a, **k: pytest.fail("started JAX"))
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model_index.json").write_text('{"_class_name": "CogVideoXPipeline"}')
    argv = ["generate", "cogvideox", "--prompt", "a panda", *[a.format(tmp=tmp_path) for a in args]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpupedia generate: "), err
    for name in names:
        assert name in err[0], (name, err[0])


@pytest.mark.parametrize("args, names", [
    (["--preset", "full", "--devices", "1"], ["--devices 1", "full preset", "machine's devices"]),
    (["--preset", "tiny", "--devices", "0"], ["--devices", "positive integer", "0"]),
])
def test_bench_devices_are_the_tiny_presets_simulated_ones(args, names, capsys, monkeypatch):
    from tpupedia import cli, devices

    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda *a, **k: pytest.fail("started JAX"))
    assert cli.main(["bench", "generate", "cogvideox", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpupedia bench: "), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_the_default_mesh_puts_dp_where_there_is_a_pair_to_split():
    from tpupedia.pipelines import common

    assert common.mesh_shape(pipeline.Options(), 8, guidance_batch=2) == (2, 4)
    assert common.mesh_shape(pipeline.Options(), 8, guidance_batch=1) == (1, 8)  # guidance off: all on tp
    assert common.mesh_shape(pipeline.Options(mesh=(1, 8)), 8, guidance_batch=2) == (1, 8)
    with pytest.raises(pipeline.PipelineError, match="dp=1 or dp=2"):
        common.mesh_shape(pipeline.Options(mesh=(8, 1)), 8, guidance_batch=2)
