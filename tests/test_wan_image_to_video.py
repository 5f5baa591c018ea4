"""Wan image-to-video (Wan2.1-I2V's layout with its CLIP image encoder, Wan2.2-I2V-A14B's with two
experts and none): frames equal to stock `WanImageToVideoPipeline` from the same weights, picture
and seed, and the `image` stage's condition and features equal to the stock pipeline's own; a
JSONL batch with a picture per line; mismatched checkpoints refused before anything loads; the
plan compiles the image stage's programs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_devices import requires_libtpu
from test_image_to_video import _picture, frames_against_stock, stage_tensors

from tpupedia import presets
from tpupedia.models import wan as family
from tpupedia.pipelines import stages
from tpupedia.pipelines import wan as pipeline

TINY = presets.get("tiny")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """The tiny image-to-video checkpoints by expert count: 1 (Wan 2.1 I2V), 2 (Wan 2.2 I2V-A14B)."""
    folder = tmp_path_factory.mktemp("wan-i2v")
    return {n: family.tiny_checkpoint(folder / f"experts-{n}", experts=n, image_to_video=True) for n in (1, 2)}


def _request(picture: str, **changes) -> pipeline.Request:
    fields = dict(prompt="a cat on a skateboard", negative_prompt="blurry", frames=9, height=64, width=64,
                  steps=3, guidance=5.0, seed=3, fps=8, image=picture)
    return pipeline.Request(**(fields | changes))


def _stage(workdir: Path, checkpoint: Path, request: pipeline.Request, stage: str) -> dict:
    return stage_tensors(pipeline, workdir, checkpoint, request, stage)


def _settings(checkpoint: Path, request: pipeline.Request, stage: str) -> dict:
    """What `stage`'s file for `request` from `checkpoint` must say (fp32, default options)."""
    configs = family.component_configs(str(checkpoint))
    return pipeline.PIPELINE.settings_for(str(checkpoint), configs, request, pipeline.Options(), torch.float32, stage)


@pytest.mark.parametrize("experts, picture, size", [(1, (40, 72, 3), (64, 64)), (2, (96, 48, 4), (64, 96))],
                         ids=["wan21-i2v-wider-rgb", "wan22-i2v-a14b-tall-rgba"])
def test_frames_match_stock_image_to_video_pipeline(checkpoints, tmp_path, experts, picture, size):
    """Same weights, picture and seed: stock `WanImageToVideoPipeline(output_type="np")` frames within
    1e-4 (fp32), for pictures whose size and aspect differ from the video's (one with alpha, which
    diffusers' load_image drops), with one expert and the CLIP features, and with two experts."""
    height, width, channels = picture
    checkpoint = checkpoints[experts]
    assert len(family.experts(family.component_configs(str(checkpoint)))) == experts  # the layout under test
    request = _request(_picture(tmp_path / "in.png", height, width, channels), height=size[0], width=size[1])
    pipe, _ = frames_against_stock(pipeline, checkpoint, request, tmp_path / "w", size, f"{experts} expert(s), {picture}")
    _check_image_stage(_stage(tmp_path / "w", checkpoint, request, "image"), pipe, request)


def _check_image_stage(ours: dict, pipe, request: pipeline.Request) -> None:
    """The `image` stage's `condition` (mask channels, then the normalised latents of the picture and
    black frames) equals what the stock pipeline's `prepare_latents` builds; with an image encoder,
    its `image_embeds` equal what `encode_image` computes with the image processor the checkpoint
    names (`CLIPImageProcessorPil` in the tiny one): the project's preprocessing is that processor's."""
    from diffusers.video_processor import VideoProcessor

    picture = Image.open(request.image).convert("RGB")
    h, w = request.height, request.width
    with torch.no_grad():
        pixels = VideoProcessor(vae_scale_factor=8).preprocess(picture, height=h, width=w)
        _, condition = pipe.prepare_latents(pixels, 1, 4, h, w, request.frames, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(request.seed))
    assert ours["condition"].shape == condition.shape == (1, 4 + 4, 3, h // 8, w // 8)
    assert torch.equal(ours["condition"][:, :4], condition[:, :4])  # the mask: latent frame 0 given, the rest not
    assert ours["condition"][:, :4, 0].min() == 1 and ours["condition"][:, :4, 1:].max() == 0
    assert float((ours["condition"] - condition).abs().max()) < 1e-5
    if pipe.image_encoder is None:  # Wan 2.2 I2V-A14B: no CLIP features
        assert "image_embeds" not in ours
        return
    assert type(pipe.image_processor).__name__ == "CLIPImageProcessorPil"
    with torch.no_grad():
        features = pipe.encode_image(picture, torch.device("cpu"))
    assert ours["image_embeds"].shape == features.shape == (1, 17, 16)  # 4x4 patches + the class token
    assert float((ours["image_embeds"] - features).abs().max()) < 1e-5


def test_a_jsonl_batch_with_a_picture_per_line(checkpoints, tmp_path):
    """A JSONL batch whose lines name pictures relative to the file: one video per line, each
    line's video made from its own picture (its record's fingerprint: settings that hold its SHA-256), the manifest
    naming the picture; a rerun skips both; a changed picture redoes only its line."""
    from tpupedia import batch

    folder = tmp_path / "prompts"
    folder.mkdir()
    _picture(folder / "a.png", 40, 40, seed=1)
    _picture(folder / "b.png", 30, 60, seed=2)
    (folder / "list.jsonl").write_text('{"prompt": "a cat", "image": "a.png"}\n'
                                       '{"prompt": "a dog", "image": "b.png", "seed": 5}\n')
    small = dict(steps=2, frames=5, height=32, width=32)  # what the test needs, at its cheapest
    base = _request(None, **small)
    options = pipeline.Options(quiet=True)
    run = lambda: pipeline.run_batch(folder / "list.jsonl", base, options, preset=TINY,  # noqa: E731
                                     model=str(checkpoints[2]), outdir=tmp_path / "out", log=lambda _: None)
    assert run() == ["0000-a-cat", "0001-a-dog"]
    assert [Path(e["image"]).name for e in batch.manifest(tmp_path / "out")] == ["a.png", "b.png"]
    records = [json.loads((tmp_path / "out" / f"{name}.json").read_text()) for name in ("0000-a-cat", "0001-a-dog")]
    for meta, image, prompt, seed in zip(records, ("a.png", "b.png"), ("a cat", "a dog"), ({}, {"seed": 5})):
        settings = _settings(checkpoints[2], _request(str(folder / image), prompt=prompt, **small, **seed), "decode")
        assert meta["fingerprint"] == stages.fingerprint(settings)  # made from its own picture (its SHA-256)
    assert records[0]["sha256"] != records[1]["sha256"]
    assert not (tmp_path / "out" / ".stages").exists()  # a finished prompt keeps no stage file
    assert run() == []  # both done
    _picture(folder / "a.png", 40, 40, seed=3)
    assert run() == ["0000-a-cat"]


def _bad_command(tmp_path: Path, case: str) -> tuple[list[str], list[str]]:
    picture = _picture(tmp_path / "ok.png", 16, 16)
    if case == "text-to-video checkpoint":
        return ["--image", picture, "--model", str(family.tiny_checkpoint(tmp_path / "t2v"))], \
            ["this checkpoint is text-to-video", "takes 4 input channels", family.FULL_ID_I2V]
    if case == "no picture for an image-to-video checkpoint":
        return ["--model", str(family.tiny_checkpoint(tmp_path / "i2v", experts=2, image_to_video=True))], \
            ["this checkpoint is image-to-video", "takes 12 input channels", "give --image PICTURE"]
    if case == "TI2V":
        model = family.tiny_checkpoint(tmp_path / "ti2v", vae=family.TI2V_VAE, expand_timesteps=True)
        return ["--image", picture, "--model", str(model)], ["Wan 2.2 TI2V", "not implemented", family.FULL_ID_I2V]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["text-to-video checkpoint", "no picture for an image-to-video checkpoint", "TI2V"])
def test_mismatched_checkpoints_are_refused_before_anything_loads(case, tmp_path, capsys, monkeypatch):
    from tpupedia import cli, devices

    args, names = _bad_command(tmp_path, case)  # (builds the checkpoints it names first: that is set-up)
    capsys.readouterr()
    monkeypatch.setattr(family, "tiny_checkpoint", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(devices, "simulate_cpu_devices", lambda *a, **k: pytest.fail("started JAX"))
    assert cli.main(["generate", "wan", "--prompt", "a cat", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpupedia generate: "), err
    for name in names:
        assert name in err[0], (name, err[0])


@requires_libtpu
def test_the_plan_compiles_the_image_stage(checkpoints, tmp_path):
    """`tpupedia plan wan --image` builds the CLIP tower and the VAE encoder's three chunk programs
    (first frame, second chunk, later chunks: 9 frames need all three), and compiles the image
    stage for the slice with the denoising step taking the condition and features as arguments
    (at 5 frames, two encoder programs: each takes tens of seconds to compile for v6e here)."""
    import jax

    from tpupedia import devices, plan

    picture = _picture(tmp_path / "p.png", 20, 30)
    configs = family.component_configs(str(checkpoints[1]))
    mesh = devices.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    built = plan.programs("wan", _request(picture, steps=2), pipeline.Options(), configs, mesh, "image",
                          dtype="float32")
    names = [p.name for p in built]
    assert names == ["CLIP vision tower, the picture at 32x32",
                     "VAE encode, first frame (the picture) (1 frame at 64x64, x 1)",
                     "VAE encode, second chunk of frames (4 frames at 64x64, x 1)",
                     "VAE encode, later chunks of frames (4 frames at 64x64, x 1)"], names
    found = plan.make("wan", _request(picture, steps=2, frames=5), pipeline.Options(), configs=configs,
                      topology="v6e:2x2", dtype="float32", stages=("image", "denoise"))
    assert [s.stage for s in found.stages] == ["image", "denoise"] and found.fits
    compiled = [p.name for p in {s.stage: s for s in found.stages}["image"].programs]
    assert compiled == names[:3], compiled
    assert found.as_dict()["request"]["image"] is True
    release = family.full_configs(image_to_video=True)
    assert family.image_to_video(release) and release["transformer"]["in_channels"] == 36
    assert family.image_to_video(family.full_configs(experts=2, image_to_video=True))
    assert not family.image_to_video(family.full_configs())
