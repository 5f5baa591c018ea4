"""HunyuanVideo-1.5 image-to-video (the i2v releases' layout: a SigLIP image encoder; and the
step-distilled release's second timestep embedding): frames equal to stock
`HunyuanVideo15ImageToVideoPipeline` from the same weights, picture and seed, at the size stock
picks from the picture; the `image` stage equal to the stock pipeline's own latents and features;
a size given with a picture and mismatched checkpoints refused before anything loads; the plan
compiles the image stage's programs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from test_devices import requires_libtpu
from test_image_to_video import _picture, frames_against_stock, stage_tensors

from tpupedia import presets
from tpupedia.models import hunyuan as family
from tpupedia.pipelines import hunyuan as pipeline

TINY = presets.get("tiny")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The tiny image-to-video checkpoints: the i2v releases' layout, and with `use_meanflow` the
    step-distilled 480p release's."""
    folder = tmp_path_factory.mktemp("hunyuan-i2v")
    return {"i2v": family.tiny_checkpoint(folder / "i2v", image_to_video=True),
            "meanflow": family.tiny_checkpoint(folder / "meanflow", image_to_video=True, transformer={"use_meanflow": True})}


def _request(picture: str | None, **changes) -> pipeline.Request:
    fields = dict(prompt="a cat on a skateboard", negative_prompt="blurry", frames=9, steps=3, seed=7, fps=8,
                  image=picture)
    return pipeline.Request(**(fields | changes))


def _stage(workdir: Path, checkpoint: Path, request: pipeline.Request, stage: str) -> dict:
    return stage_tensors(pipeline, workdir, checkpoint, request, stage)


@pytest.mark.parametrize("kind, picture, size", [("i2v", (40, 72, 3), (48, 80)), ("meanflow", (96, 48, 4), (80, 48))],
                         ids=["i2v-wider-rgb", "step-distilled-tall-rgba"])
def test_frames_match_stock_image_to_video_pipeline(checkpoints, tmp_path, kind, picture, size):
    """Same weights, picture and seed: stock `HunyuanVideo15ImageToVideoPipeline(output_type="np")`
    frames within 1e-4 (fp32). The video's size is the bucket stock picks from the picture's
    aspect (a 72x40 picture -> 80x48 around the tiny target size 64); one picture has alpha, which
    diffusers' load_image drops; the step-distilled layout also embeds the next step's timestep."""
    height, width, channels = picture
    checkpoint = checkpoints[kind]
    configs = family.component_configs(str(checkpoint))
    assert family.image_to_video(configs) and bool(configs["transformer"].get("use_meanflow")) == (kind == "meanflow")
    request = _request(_picture(tmp_path / "in.png", height, width, channels))
    pipe, reports = frames_against_stock(pipeline, checkpoint, request, tmp_path / "w", size, f"{kind}, {picture}")
    image = _stage(tmp_path / "w", checkpoint, request, "image")
    _check_image_stage(image, pipe, request, size)
    kept = {r.stage: r for r in reports}["denoise"].timings["text_tokens"]
    assert kept >= family.image_tokens(configs)  # the picture's tokens are kept


def _check_image_stage(ours: dict, pipe, request: pipeline.Request, size: tuple[int, int]) -> None:
    """The `image` stage equals what the stock pipeline computes for the same picture: its
    `image_latents` the VAE's posterior mean of the cropped picture times the scaling factor
    (`_get_image_latents`), its `image_embeds` SigLIP's last hidden state through the feature
    extractor the checkpoint names (`SiglipImageProcessorPil` in the tiny one): the project's
    preprocessing is that processor's."""
    height, width = size
    picture = pipe.video_processor.resize(Image.open(request.image).convert("RGB"), height=height, width=width,
                                          resize_mode="crop")
    with torch.no_grad():
        latents = pipe._get_image_latents(pipe.vae, pipe.video_processor, picture, height, width, torch.device("cpu"))
        features = pipe.encode_image(picture, 1, torch.device("cpu"), torch.float32)
    assert ours["image_latents"].shape == latents.shape == (1, 4, 1, height // 16, width // 16)
    assert float((ours["image_latents"] - latents).abs().max()) < 1e-5
    assert type(pipe.feature_extractor).__name__ == "SiglipImageProcessorPil"
    assert ours["image_embeds"].shape == features.shape == (1, 16, 12)  # 4x4 patches of 8 over 32 px
    assert float((ours["image_embeds"] - features).abs().max()) < 1e-5


def test_a_tiled_encode_matches_the_stock_tiled_encode(tmp_path):
    """With `vae_tiling` on, the picture is encoded in diffusers' 256-pixel tiles (ours run side by
    side on the host's chips, the blending stock code): the image stage's latents equal the stock
    pipeline's tiled `_get_image_latents` within 1e-5. A checkpoint whose target size is 320
    makes a square picture 320x320, so the encode really tiles (2 x 2: its latents differ from
    the untiled encode's). The frames after it are the same code as the untiled case above."""
    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt", image_to_video=True, transformer={"target_size": 320})
    request = _request(_picture(tmp_path / "in.png", 50, 50), frames=5, steps=2, vae_tiling=True)
    reports = pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint),
                           workdir=tmp_path / "w", stage="image", log=lambda _: None)
    assert [r.stage for r in reports] == ["image"]
    ours = _stage(tmp_path / "w", checkpoint, request, "image")["image_latents"]
    pipe, _ = pipeline.stock(str(checkpoint), request)
    picture = pipe.video_processor.resize(Image.open(request.image).convert("RGB"), height=320, width=320,
                                          resize_mode="crop")
    with torch.no_grad():
        tiled = pipe._get_image_latents(pipe.vae, pipe.video_processor, picture, 320, 320, torch.device("cpu"))
        pipe.vae.disable_tiling()
        untiled = pipe._get_image_latents(pipe.vae, pipe.video_processor, picture, 320, 320, torch.device("cpu"))
    assert ours.shape == tiled.shape == (1, 4, 1, 20, 20)
    error = float((ours - tiled).abs().max())
    print(f"tiled encode: max abs error vs stock {error:.2e}; tiled vs untiled {float((tiled - untiled).abs().max()):.2e}")
    assert error < 1e-5
    assert float((tiled - untiled).abs().max()) > 1e-3  # tiling changes the latents: the test can tell


def test_the_video_size_is_the_bucket_nearest_the_pictures_aspect():
    """The release's buckets (target size 960, multiples of 16): a 16:9 picture gives 1280x720;
    a 3:2 one the bucket just wider than 3:2 in height over width (stock keeps the picture's
    orientation and never crops its short side away); the same picture turned gives it turned."""
    release = family.full_configs(image_to_video=True)
    assert family.image_to_video(release) and not family.image_to_video(family.full_configs())
    assert family.image_tokens(release) == 729 == family.image_tokens(family.full_configs())
    assert family.video_size(1920, 1080, release) == (1280, 720)
    width, height = family.video_size(96, 64, release)
    assert (width, height) == (1168, 784) and height / width >= 64 / 96
    assert family.video_size(64, 96, release) == (784, 1168)


def test_the_image_stage_is_kept_when_only_the_frame_count_changes(checkpoints, tmp_path):
    """The image stage encodes the picture alone (one latent frame, its SigLIP features), so its
    stage file stays valid for a request with more frames; the denoise's does not; another
    picture (or its encode tiled) is another image stage."""
    source = str(checkpoints["i2v"])
    configs = family.component_configs(source)
    picture = _picture(tmp_path / "a.png", 40, 72)

    def settings(stage: str, **changes) -> dict:
        return pipeline.Hunyuan.settings_for(source, configs, _request(picture, **changes), pipeline.Options(),
                                             torch.float32, stage)

    assert settings("image", frames=9) == settings("image", frames=13)
    assert settings("denoise", frames=9) != settings("denoise", frames=13)
    assert settings("image") != settings("image", image=_picture(tmp_path / "b.png", 40, 72, seed=1))
    assert settings("image") != settings("image", vae_tiling=True)


def _bad_command(tmp_path: Path, checkpoints: dict, case: str) -> tuple[list[str], list[str]]:
    picture = _picture(tmp_path / "ok.png", 16, 16)
    if case == "text-to-video checkpoint":
        return ["--image", picture, "--model", str(family.tiny_checkpoint(tmp_path / "t2v"))], \
            ["this checkpoint is text-to-video", "names no image encoder", family.FULL_ID_I2V]
    if case == "no picture for an image-to-video checkpoint":
        return ["--model", str(checkpoints["i2v"])], \
            ["this checkpoint is image-to-video", "names an image encoder", "give --image PICTURE"]
    if case == "a size with the picture":
        return ["--image", picture, "--width", "64"], ["--width", "takes the video's size from the picture"]
    if case == "DeepCache on a step-distilled checkpoint":
        return ["--image", picture, "--model", str(checkpoints["meanflow"]), "--deepcache", "1:3:2"], \
            ["deepcache", "step-distilled (use_meanflow"]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["text-to-video checkpoint", "no picture for an image-to-video checkpoint",
                                  "a size with the picture", "DeepCache on a step-distilled checkpoint"])
def test_mismatched_requests_are_refused_before_anything_loads(case, checkpoints, tmp_path, capsys, monkeypatch):
    from tpupedia import cli, devices

    args, names = _bad_command(tmp_path, checkpoints, case)  # (builds the checkpoints it names first: set-up)
    capsys.readouterr()
    monkeypatch.setattr(family, "tiny_checkpoint", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda *a, **k: pytest.fail("started JAX"))
    assert cli.main(["generate", "hunyuan", "--prompt", "a cat", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpupedia generate: "), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_a_jsonl_line_with_a_size_and_a_picture_is_refused(checkpoints, tmp_path):
    """In a JSONL batch the same rule names the line: its `width` cannot apply to a picture."""
    from tpupedia import batch
    from tpupedia.pipelines import common

    _picture(tmp_path / "a.png", 20, 20)
    (tmp_path / "list.jsonl").write_text('{"prompt": "a cat", "image": "a.png"}\n'
                                         '{"prompt": "a dog", "image": "a.png", "width": 64}\n')
    with pytest.raises(common.PipelineError, match=r"prompt 1 \('a dog'\): \"width\": hunyuan image-to-video"):
        common.batch_requests(pipeline.Hunyuan, batch.read_prompts(tmp_path / "list.jsonl"), _request(None),
                              pipeline.Options(), configs=family.component_configs(str(checkpoints["i2v"])))


@requires_libtpu
def test_the_plan_compiles_the_image_stage(checkpoints, tmp_path):
    """`tpupedia plan hunyuan --image` compiles the SigLIP tower and the VAE encoder on the picture's
    frame at the size the picture gives, and the denoising step with the condition as an argument."""
    from tpupedia import plan

    request = _request(_picture(tmp_path / "p.png", 20, 30), steps=2)
    found = plan.make("hunyuan", request, pipeline.Options(), configs=family.component_configs(str(checkpoints["i2v"])),
                      topology="v6e:2x2", dtype="float32", stages=("image", "denoise"))
    assert [s.stage for s in found.stages] == ["image", "denoise"] and found.fits
    names = [p.name for p in {s.stage: s for s in found.stages}["image"].programs]
    assert names[0] == "SigLIP vision tower, the picture at 32x32" and len(names) == 2, names
    assert names[1] == "VAE encode, the picture (48x64 pixels, a copy on each chip, x 1)", names
    assert found.as_dict()["request"]["image"] is True


def test_a_folder_holding_another_tiny_checkpoint_is_refused(checkpoints):
    """A tiny checkpoint asked for in a folder that holds another one (here the i2v layout's folder
    asked for the step-distilled layout) is refused by name, not silently reused: a parity test
    would otherwise compare the wrong layout and pass."""
    from tpupedia.models.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="holds another tiny checkpoint"):
        family.tiny_checkpoint(checkpoints["i2v"], image_to_video=True, transformer={"use_meanflow": True})
    assert family.tiny_checkpoint(checkpoints["i2v"], image_to_video=True) == checkpoints["i2v"]  # the same: reused


def test_the_preflight_plans_each_pictures_aspect(tmp_path, monkeypatch):
    """The full preset's pre-run plan (`plan.preflight`) caches its answer per shape; image-to-video
    takes the video's size from the picture's aspect (`resolve`), so a tall picture after a wide one
    is planned anew, while another picture of the same aspect reuses the answer."""
    from types import SimpleNamespace

    from tpupedia import plan

    configs = family.full_configs(image_to_video=True)  # the 720p i2v release's, no download
    chips = [SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")] * 8
    planned = []

    def make(name, request, options, *, configs, **kwargs):
        planned.append(pipeline.resolve(request, configs))
        return SimpleNamespace(fits=True, vae_tiling=False, advice=lambda: "", summary=lambda: "fits", stages=[], hbm=0.0,
                               request={}, notes=[],
                               host_copy=0.0)

    monkeypatch.setattr(plan, "make", make)
    pictures = [_picture(tmp_path / "wide.png", 72, 128), _picture(tmp_path / "tall.png", 128, 72),
                _picture(tmp_path / "wide-large.png", 144, 256)]
    for picture in pictures:
        plan.preflight("hunyuan", _request(picture), pipeline.Options(), configs, chips,
                       cache_dir=tmp_path / "plans", log=lambda _: None)
    assert [(r.width, r.height) for r in planned] == [
        family.video_size(128, 72, configs), family.video_size(72, 128, configs)]
    assert planned[0].width > planned[0].height and planned[1].width < planned[1].height
