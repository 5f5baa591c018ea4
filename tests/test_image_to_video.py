"""Image-to-video (CogVideoX1.5-5B-I2V's layout): frames equal to stock
`CogVideoXImageToVideoPipeline` from the same weights, picture and seed; the `image` stage file
tied to the picture; bad pictures and mismatched checkpoints refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_devices import requires_libtpu

from tpupedia import presets
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import cogvideox as pipeline
from tpupedia.pipelines import stages

TINY = presets.get("tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return family.tiny_checkpoint(tmp_path_factory.mktemp("i2v"), image_to_video=True)


def _picture(path: Path, height: int, width: int, channels: int = 3, seed: int = 0) -> str:
    pixels = (np.random.default_rng(seed).random((height, width, channels)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


def _request(picture: str, **changes) -> pipeline.Request:
    fields = dict(prompt="a panda playing a guitar", negative_prompt="blurry", frames=9, height=32, width=32,
                  steps=4, guidance=6.0, seed=3, fps=8, image=picture)
    return pipeline.Request(**(fields | changes))


def stage_tensors(module, workdir: Path, checkpoint: Path, request, stage: str) -> dict:
    """The tensors of `stage` that `module` (a family's pipeline module) wrote under `workdir` for
    `request` from `checkpoint`, fp32: read back with the settings a run checks them against."""
    configs = module.PIPELINE.family.component_configs(str(checkpoint))
    settings = module.PIPELINE.settings_for(str(checkpoint), configs, request, module.Options(), torch.float32, stage)
    return stages.read(workdir, stage, settings).tensors


def frames_against_stock(module, checkpoint: Path, request, workdir: Path, size: tuple[int, int], label: str):
    """Stock's image-to-video pipeline (`module.stock`) and every stage of ours on the same
    weights, picture and seed, fp32: the frames (9 of `size`) within 1e-4 and not flat.
    Returns the stock pipeline, for the image stage's own checks."""
    pipe, call = module.stock(str(checkpoint), request)
    expected = pipe(**call).frames[0]
    reports = module.run(request, module.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=workdir,
                         log=lambda _: None)
    assert [r.stage for r in reports] == ["text", "image", "denoise", "decode"] and all(r.ran for r in reports)
    frames = stage_tensors(module, workdir, checkpoint, request, "decode")["frames"].numpy()
    assert frames.shape == expected.shape == (9, *size, 3)
    error = float(np.abs(frames - expected).max())
    print(f"{label} -> {size}: max abs error vs stock {type(pipe).__name__} {error:.2e}")
    assert error <= 1e-4, error
    assert frames.std() > 0.01
    return pipe, reports


@pytest.mark.parametrize("picture, size", [((64, 20, 4), (32, 32))], ids=["tall-rgba"])
def test_frames_match_stock_image_to_video_pipeline(checkpoint, tmp_path, picture, size):
    """Same weights, picture and seed: stock `CogVideoXImageToVideoPipeline(output_type="np")`
    frames within 1e-4 (fp32), for a picture whose size and aspect differ from the video's, with
    alpha, which diffusers' load_image drops. (The video stays 32x32: the tiny transformer's RoPE
    grid, from its `sample_height/width` of 4, is 2x2 patches.) Notebook `cogvideox_pipeline`'s asserts prove a wider
    RGB picture."""
    height, width, channels = picture
    request = _request(_picture(tmp_path / "in.png", height, width, channels), height=size[0], width=size[1])
    frames_against_stock(pipeline, checkpoint, request, tmp_path / "w", size, str(picture))


def test_a_changed_picture_reruns_its_stage_and_refuses_the_old_file(checkpoint, tmp_path):
    first = _request(_picture(tmp_path / "a.png", 32, 32, seed=1), steps=2)
    pipeline.run(first, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                 log=lambda _: None)
    again = pipeline.run(first, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                         log=lambda _: None)
    assert not any(r.ran for r in again)  # the same picture: every stage up to date
    _picture(tmp_path / "a.png", 32, 32, seed=2)  # the same path, other pixels
    configs = family.component_configs(str(checkpoint))
    with pytest.raises(stages.StageError, match="image"):
        stages.read(tmp_path, "image", pipeline.CogVideoX.settings_for(str(checkpoint), configs, first,
                                                                      pipeline.Options(), torch.float32, "image"))
    reports = pipeline.run(first, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), workdir=tmp_path,
                           log=lambda _: None)
    assert [(r.stage, r.ran) for r in reports] == [("text", False), ("image", True), ("denoise", True), ("decode", True)]


def _bad_command(tmp_path: Path, case: str) -> tuple[list[str], list[str]]:
    picture = _picture(tmp_path / "ok.png", 16, 16)
    if case == "not a picture":
        (tmp_path / "notes.png").write_text("hello")
        return ["--image", str(tmp_path / "notes.png")], ["notes.png", "not a picture Pillow can read"]
    if case == "missing":
        return ["--image", str(tmp_path / "gone.jpg")], ["gone.jpg", "no such file"]
    if case == "too large":
        Image.new("L", (9000, 2)).save(tmp_path / "wide.png")
        return ["--image", str(tmp_path / "wide.png")], ["9000x2", "at most 8192"]
    if case == "text-to-video checkpoint":
        return ["--image", picture, "--model", str(family.tiny_checkpoint(tmp_path / "t2v"))], \
            ["this checkpoint is text-to-video", "takes 4 input channels", family.FULL_ID_I2V]
    if case == "no picture for an image-to-video checkpoint":
        return ["--model", str(family.tiny_checkpoint(tmp_path / "i2v", image_to_video=True))], \
            ["this checkpoint is image-to-video", "give --image PICTURE"]
    if case == "a batch mixing pictures and none":
        (tmp_path / "prompts.jsonl").write_text('{"prompt": "a panda", "image": "ok.png"}\n{"prompt": "a cat"}\n')
        return ["--prompts", str(tmp_path / "prompts.jsonl"), "--outdir", str(tmp_path / "out")], \
            ["prompt 1 has no picture", "1 of the batch's 2", "a batch runs one checkpoint"]
    if case == "a bad picture in a batch":
        (tmp_path / "prompts.jsonl").write_text('{"prompt": "a panda", "image": "ok.png"}\n'
                                                '{"prompt": "a cat", "image": "gone.png"}\n')
        return ["--prompts", str(tmp_path / "prompts.jsonl"), "--outdir", str(tmp_path / "out")], \
            ["prompt 1 ('a cat')", "gone.png", "no such file"]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["not a picture", "missing", "too large", "text-to-video checkpoint",
                                  "no picture for an image-to-video checkpoint", "a batch mixing pictures and none",
                                  "a bad picture in a batch"])
def test_bad_pictures_and_mismatched_checkpoints_are_refused_before_anything_loads(case, tmp_path, capsys,
                                                                                    monkeypatch):
    from tpupedia import cli, devices

    args, names = _bad_command(tmp_path, case)  # (builds the checkpoints it names first: that is set-up)
    capsys.readouterr()
    monkeypatch.setattr(family, "tiny_checkpoint", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda *a, **k: pytest.fail("started JAX"))
    prompt = [] if "--prompts" in args else ["--prompt", "a panda"]
    assert cli.main(["generate", "cogvideox", *prompt, *(["--preset", "tiny"] if "--model" not in args else []),
                     *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpupedia generate: "), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_the_image_stage_needs_a_picture(checkpoint, tmp_path):
    request = pipeline.Request(prompt="a panda", frames=9, height=32, width=32, steps=2)
    with pytest.raises(pipeline.PipelineError, match="the image stage needs a picture"):
        pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, stage="image", workdir=tmp_path,
                     log=lambda _: None)


def test_generate_with_a_picture_writes_a_video(tmp_path, run_cli):
    picture = _picture(tmp_path / "start.png", 24, 40, channels=4)
    # the claim is a file, not a video: one step, one frame, the smallest size (faster to make)
    done = run_cli("generate", "cogvideox", "--preset", "tiny", "--prompt", "a panda", "--image", picture,
                   "--out", "panda.mp4", "--workdir", "w", "--steps", "1", "--frames", "1", "--height", "16",
                   "--width", "16", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "panda.mp4").stat().st_size > 1000 and (tmp_path / "w" / "image.safetensors").exists()


@requires_libtpu
def test_the_plan_compiles_the_image_encoder_with_the_other_stages(checkpoint, tmp_path):
    """`tpupedia plan` (and the full preset's preflight) compile the image stage's encoder for the
    slice beside text, denoise and decode, and the denoising step takes the picture's channels."""
    from tpupedia import plan

    request = _request(_picture(tmp_path / "p.png", 20, 30), steps=2)
    found = plan.make("cogvideox", request, pipeline.Options(), configs=family.component_configs(str(checkpoint)),
                      topology="v6e:2x2", dtype="float32")
    assert [s.stage for s in found.stages] == ["text", "image", "denoise", "decode"] and found.fits
    (encoder,) = {s.stage: s for s in found.stages}["image"].programs
    assert encoder.name == "VAE encoder, the picture at 32x32" and encoder.component == "vae"
    assert found.as_dict()["request"]["image"] is True
    assert family.image_to_video(family.full_configs(image_to_video=True))
    assert not family.image_to_video(family.full_configs())
