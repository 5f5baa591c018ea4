"""Videos (notebook `cogvideox_pipeline`): a machine that cannot write an mp4 is refused before any stage runs, and
frames that are no picture (NaN, one flat colour) are refused before the mp4 is written."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tpupedia import cli, families, video
from tpupedia.pipelines import common


@pytest.fixture
def no_encoder(monkeypatch):
    """This process as if `imageio-ffmpeg` were not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))


def test_a_missing_encoder_is_one_line_naming_the_package_and_the_pip_command(no_encoder):
    with pytest.raises(video.VideoError, match=r"imageio-ffmpeg package, which is not installed: pip install imageio-ffmpeg"):
        video.check_encoder()


@pytest.mark.parametrize("args", [["--prompt", "a panda", "--out", "panda.mp4"], ["--prompts", "p.txt", "--outdir", "out"]],
                         ids=["out", "batch"])
def test_generate_refuses_a_missing_encoder_before_any_stage(no_encoder, monkeypatch, capsys, tmp_path, args):
    """`--out` used to fail with a traceback after the decode stage (the TPU VM guide installed
    `.[tpu]`, without the video extra); a batch writes an mp4 per prompt."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_generate_setup", lambda *a: pytest.fail("the run started"))
    first = families.video()[0].name
    assert cli.main(["generate", first, "--preset", "tiny", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "imageio-ffmpeg" in err and "pip install" in err, err
    assert list(tmp_path.iterdir()) == []


def test_run_batch_checks_the_encoder_first(no_encoder, tmp_path):
    with pytest.raises(video.VideoError, match="imageio-ffmpeg"):
        common.run_batch(None, tmp_path / "no-prompts.txt", None, None, preset=None, outdir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("frames, message", [
    (np.full((5, 8, 8, 3), np.nan, np.float32), "960 of 960 frame values are NaN or infinite"),
    (np.zeros((5, 8, 8, 3), np.float32), "single flat colour"),
    (np.broadcast_to(np.float32([0.2, 0.5, 0.9]), (5, 8, 8, 3)).copy(), "single flat colour"),
], ids=["nan", "black", "one-colour"])
def test_frames_that_are_no_picture_are_refused_before_the_mp4_naming_the_stage(tmp_path, frames, message):
    out = tmp_path / "video.mp4"
    with pytest.raises(video.VideoError, match=message) as err:
        common._write_video(None, SimpleNamespace(fps=8), tmp_path, out, {"frames": torch.from_numpy(frames)})
    assert "the decode stage's frames" in str(err.value) and "decode.safetensors" in str(err.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_picture_passes_the_frame_check():
    frames = np.random.default_rng(0).random((5, 8, 8, 3), dtype=np.float32)
    frames[1:] = frames[0]  # a still video is a picture: only flat frames are refused
    video.check_frames(frames, "frames")
