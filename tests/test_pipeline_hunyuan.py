"""The HunyuanVideo-1.5 pipeline (notebook `hunyuan_video`): parity with stock diffusers with tiling and
without guidance, DeepCache's two programs and upstream's schedule, bad input refused before any
model is loaded, and the command line. Notebook `hunyuan_video`'s asserts prove the guided parity with glyph
text and that DeepCache at interval 1 is the plain pipeline bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_pipeline_cogvideox import _stock_frames_tiled_and_untiled

from tpupedia import metrics, presets
from tpupedia.errors import TpupediaError
from tpupedia.models import hunyuan as family
from tpupedia.pipelines import deepcache, stages
from tpupedia.pipelines import hunyuan as pipeline

TINY = presets.get("tiny")
REQUEST = pipeline.Request(prompt='a neon sign that says "OPEN" in the rain', negative_prompt="blurry", frames=9,
                           height=64, width=64, steps=3, seed=7, fps=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return family.tiny_checkpoint(tmp_path_factory.mktemp("hunyuan-ckpt"))


def _stock_frames(checkpoint: Path, request: pipeline.Request) -> np.ndarray:
    pipe, call = pipeline.stock(str(checkpoint), request)
    return pipe(**call).frames[0]


def _frames(workdir: Path, checkpoint: Path, request: pipeline.Request) -> np.ndarray:
    settings = pipeline.Hunyuan.settings_for(str(checkpoint), family.component_configs(str(checkpoint)), request,
                                             pipeline.Options(), torch.float32, "decode")
    return stages.read(workdir, "decode", settings).tensors["frames"].numpy()


def _run(checkpoint: Path, request: pipeline.Request, workdir: Path, **options):
    return pipeline.run(request, pipeline.Options(quiet=True, **options), preset=TINY, model=str(checkpoint),
                        workdir=workdir, log=lambda _: None)


def test_tiled_frames_match_stock_diffusers_tiled(checkpoint, tmp_path):
    """`vae_tiling` on both sides (stock `vae.enable_tiling()`; ours the same VAE's tiles, each
    decoder call jitted): the same frames, fp32, 1e-4. At 288x288 the 256-pixel tiles, one every 192,
    split the video 2 x 2, so tiling really changes pixels: stock's VAE decoding the same latents
    untiled differs. Tiles are spatial, so one frame and one step are enough."""
    request = dataclasses.replace(REQUEST, prompt="a quiet lake at dawn", frames=1, height=288, width=288, steps=1,
                                  vae_tiling=True)
    expected, untiled = _stock_frames_tiled_and_untiled(str(checkpoint), pipeline.stock, request)
    _run(checkpoint, request, tmp_path)
    frames = _frames(tmp_path, checkpoint, request)
    assert frames.shape == expected.shape == untiled.shape == (1, 288, 288, 3)
    error = float(np.abs(frames - expected).max())
    assert error <= 1e-4, error
    assert float(np.abs(untiled - expected).max()) > 1e-3  # the seams are real: tiled is not untiled


def test_guidance_one_runs_a_single_forward_per_step(checkpoint, tmp_path):
    """Guidance 1 turns the guider off: no negative prompt is encoded, one batch-1 forward a step."""
    request = dataclasses.replace(REQUEST, prompt="a quiet lake at dawn", guidance=1.0, steps=2)
    expected = _stock_frames(checkpoint, request)
    _run(checkpoint, request, tmp_path)
    settings = pipeline.Hunyuan.settings_for(str(checkpoint), family.component_configs(str(checkpoint)), request,
                                             pipeline.Options(), torch.float32, "text")
    assert not any(k.startswith("negative_") for k in stages.read(tmp_path, "text", settings).tensors)
    assert float(np.abs(_frames(tmp_path, checkpoint, request) - expected).max()) <= 1e-4
    denoise = stages.read(tmp_path, "denoise", pipeline.Hunyuan.settings_for(
        str(checkpoint), family.component_configs(str(checkpoint)), request, pipeline.Options(), torch.float32, "denoise"))
    assert denoise.meta["extra"]["mesh"] == {"dp": 1, "tp": 8}  # no pair to split: every device on tp
    with pytest.raises(pipeline.PipelineError, match="guidance batch of 1"):  # the guider's setting, read from its config
        _run(checkpoint, request, tmp_path / "dp2", mesh=(2, 4))


def test_upstream_default_schedule():
    """11:45:4 over 50 steps: steps 0-10, every 4th from 11 to 43, and 45-49 run in full (25)."""
    full = deepcache.UPSTREAM_DEFAULT.full_steps(50)
    assert full == [*range(11), 11, 15, 19, 23, 27, 31, 35, 39, 43, 45, 46, 47, 48, 49]
    assert len(full) == 25 and str(deepcache.UPSTREAM_DEFAULT) == "11:45:4"
    assert deepcache.parse("11:45:4") == deepcache.UPSTREAM_DEFAULT


@pytest.mark.parametrize("change, message", [
    ({"frames": 10}, "frames=10"),
    ({"height": 40}, "64x40"),
    ({"prompt": "  "}, "prompt is empty"),
    ({"steps": 0}, "steps=0"),
    ({"shift": -1.0}, "shift=-1.0"),
    ({"deepcache": deepcache.Schedule(0, 5, 1)}, "end <= steps=3"),
    ({"deepcache": deepcache.Schedule(0, 3, 0)}, "interval=0"),
])
def test_bad_requests_are_refused_before_any_model_loads(change, message, monkeypatch, tmp_path):
    monkeypatch.setattr(family, "model_source", lambda *a, **k: pytest.fail("a model was loaded before validation"))
    with pytest.raises(TpupediaError, match=message):
        pipeline.run(dataclasses.replace(REQUEST, **change), pipeline.Options(), preset=TINY, workdir=tmp_path,
                     log=lambda _: None)
    with pytest.raises(TpupediaError, match="needs 9 devices"):
        pipeline.run(REQUEST, pipeline.Options(mesh=(3, 3)), preset=TINY, workdir=tmp_path, log=lambda _: None)
    with pytest.raises(TpupediaError, match="vae='flax' is not one of torchax"):
        pipeline.run(REQUEST, pipeline.Options(vae="flax"), preset=TINY, workdir=tmp_path, log=lambda _: None)


def test_deepcache_text_is_parsed_or_refused():
    for text in ("11:45", "a:b:c", "1:2:3:4"):
        with pytest.raises(deepcache.DeepCacheError, match="START:END:INTERVAL"):
            deepcache.parse(text)


def test_quality_metrics():
    """scikit-image's PSNR and SSIM, frame by frame: equal frames are inf dB and 1, noise lowers both."""
    rng = np.random.default_rng(0)
    a = rng.random((3, 16, 16, 3))
    assert metrics.psnr(a, a) == float("inf") and metrics.ssim(a, a) == pytest.approx(1.0)
    noisy = np.clip(a + rng.normal(0, 0.1, a.shape), 0, 1)
    assert 15 < metrics.psnr(noisy, a) < 25  # noise of std 0.1 (clipped): about 20 dB
    assert metrics.ssim(noisy, a) < metrics.ssim(np.clip(a + rng.normal(0, 0.01, a.shape), 0, 1), a) < 1


def test_cli_generates_a_video_and_refuses_a_bad_schedule_in_one_line(tmp_path, run_cli):
    # the claim is a file, not a video: one step, one frame, the smallest size (faster to make)
    done = run_cli("generate", "hunyuan", "--preset", "tiny", "--prompt", "a fox", "--out", "fox.mp4", "--workdir", "w",
                   "--steps", "1", "--frames", "1", "--height", "16", "--width", "16", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    video = tmp_path / "fox.mp4"
    assert video.stat().st_size > 1000 and video.read_bytes()[4:8] == b"ftyp"  # an ISO-BMFF (mp4) file
    bad = run_cli("generate", "hunyuan", "--preset", "tiny", "--prompt", "a fox", "--deepcache", "2:9:1", cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "2:9:1" in lines[0] and "steps=4" in lines[0], bad.stderr


def test_bench_deepcache_records_steps_quality_and_time(checkpoint, monkeypatch):
    """`bench_deepcache` runs the plain pipeline and the cached one (`1:4:2`: steps 0, 1 and 3 in
    full) and records steps, quality and time. The cached run compiles two step programs, the full
    one and the cached one, once each for its 4 steps (and not the plain step); the plain run, the
    plain step only."""
    from tpupedia import bench

    request = dataclasses.replace(REQUEST, prompt="a fox", steps=4, deepcache=deepcache.Schedule(1, 4, 2))
    assert request.deepcache.full_steps(4) == [0, 1, 3]
    traces = []  # each run's compiles, in order: plain, then cached
    real = pipeline.Hunyuan.denoise

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        traces.append(dict(self.traces))
        return out

    monkeypatch.setattr(pipeline.Hunyuan, "denoise", spy)
    record = bench.bench_deepcache("hunyuan", TINY, request, pipeline.Options(quiet=True), model=str(checkpoint))
    plain, cached = traces
    assert (plain["denoise"], plain["full"], plain["cached"]) == (1, 0, 0)
    assert (cached["denoise"], cached["full"], cached["cached"]) == (0, 1, 1)  # one compile each, 4 steps
    result = record["result"]
    assert record["bench"] == "deepcache" and record["config"]["deepcache"] == "1:4:2"
    assert result["full_steps"] == 3 and result["steps"] == 4 and 1 < result["bound"] < 4 / 3
    assert 0 < result["ssim"] <= 1 and result["psnr_db"] > 0 and result["plain_s"] > 0 and result["cached_s"] > 0


def test_bfloat16_as_the_full_preset_runs_it(checkpoint, tmp_path):
    """The released checkpoint runs in bf16: every stage on the tiny model, close to stock diffusers in bf16."""
    request = dataclasses.replace(REQUEST, steps=2)
    pipeline.run(request, pipeline.Options(quiet=True, dtype="bfloat16"), preset=TINY, model=str(checkpoint),
                 workdir=tmp_path, log=lambda _: None)
    configs = family.component_configs(str(checkpoint))
    read = lambda stage: stages.read(tmp_path, stage, pipeline.Hunyuan.settings_for(  # noqa: E731
        str(checkpoint), configs, request, pipeline.Options(), torch.bfloat16, stage)).tensors
    assert read("text")["prompt_embeds"].dtype == read("denoise")["latents"].dtype == torch.bfloat16
    frames = read("decode")["frames"]
    assert frames.dtype == torch.float32 and torch.isfinite(frames).all()
    pipe, call = pipeline.stock(str(checkpoint), request, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = pipe(**call).frames[0]
    assert float((frames - torch.from_numpy(np.asarray(expected, np.float32))).abs().mean()) < 0.05
