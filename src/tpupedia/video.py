"""Frames to an mp4 file, written atomically.

Frames are what diffusers returns with `output_type="np"` (float32 `(F, H, W, 3)` in [0, 1])
and what a decode stage file holds. They are rounded to 8-bit and encoded as H.264 (yuv420p,
what browsers and players accept) with the ffmpeg binary that the `imageio-ffmpeg` wheel ships.

Introduced in notebook `cogvideox_pipeline` (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tpupedia import files
from tpupedia.errors import TpupediaError

__all__ = ["VideoError", "ENCODER", "check_encoder", "check_frames", "output_bytes", "to_uint8", "write_mp4", "show_frames"]

ENCODER = "imageio-ffmpeg"
"""The package whose ffmpeg binary writes the mp4 (in the course's `video` extra)."""


class VideoError(TpupediaError, ValueError):
    """Frames that cannot be written as a video (wrong shape, range or size)."""


def check_encoder() -> None:
    """Refuse, in one line naming the package and the pip command, a machine that cannot write an
    mp4 (no `imageio-ffmpeg`, or its ffmpeg binary missing): called before any stage runs when a
    command will write a video (`--out`, a batch), not after the decode stage."""
    import importlib.util

    how = f"pip install {ENCODER}  (or the course's video extra: pip install -e '.[video]')"
    if importlib.util.find_spec("imageio_ffmpeg") is None:
        raise VideoError(f"writing an mp4 needs the {ENCODER} package, which is not installed: {how}")
    import imageio_ffmpeg

    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as err:
        raise VideoError(f"{ENCODER} is installed but has no ffmpeg binary ({err}): reinstall it, {how}") from None


def check_frames(frames: np.ndarray, what: str) -> None:
    """Refuse a video that is not a picture: NaN or infinite values (a diverged denoise, a bf16
    overflow) or frames that are each one flat colour (every pixel of every frame alike, as
    all-zero latents decode), naming `what` made them (the stage and its file), before an mp4
    that looks like a result is written."""
    frames = np.asarray(frames)
    bad = int(np.size(frames) - np.isfinite(frames).sum())
    if bad:
        raise VideoError(f"{what}: {bad} of {frames.size} frame values are NaN or infinite; no video written "
                         "(rerun the denoise and decode stages with --force, or --dtype float32)")
    if frames.ndim == 4 and frames.size and not np.ptp(frames, axis=(1, 2)).any():
        raise VideoError(f"{what}: every one of the {len(frames)} frames is a single flat colour "
                         f"(values {float(frames.min()):.3g} to {float(frames.max()):.3g}); no video written")


def output_bytes(frames: int, height: int, width: int) -> int:
    """Bytes a run of one video writes, at most: its decode stage file (float32 frames, `frames *
    height * width * 3 * 4`) plus the mp4, bounded by a tenth of the 8-bit frames (2.4 bits a
    pixel, generous for H.264 at the quality `write_mp4` asks for). The text and denoise stage
    files (embeddings, latents 8x smaller a side) are small beside them. `tpupedia doctor` checks
    the free disk against it."""
    pixels = frames * height * width * 3
    return pixels * 4 + pixels // 10


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """float (F, H, W, 3) in [0, 1] -> uint8, rounded to the nearest level."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoError(f"frames of shape {frames.shape}: expected (frames, height, width, 3)")
    if not np.isfinite(frames).all() or frames.min() < 0 or frames.max() > 1:
        raise VideoError(f"frame values must be finite and in [0, 1]; got [{frames.min()}, {frames.max()}]")
    return np.round(frames * 255).astype(np.uint8)


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int = 16) -> Path:
    """Encode `frames` to `path` (H.264, yuv420p); written to a temporary file, then renamed."""
    import imageio_ffmpeg

    pixels = to_uint8(frames)
    _, height, width, _ = pixels.shape
    if height % 2 or width % 2:
        raise VideoError(f"{width}x{height}: yuv420p needs an even width and height")
    path = Path(path)

    def encode(tmp: Path) -> None:
        writer = imageio_ffmpeg.write_frames(str(tmp), (width, height), fps=fps, codec="libx264",
                                             pix_fmt_out="yuv420p", macro_block_size=1, quality=8,
                                             ffmpeg_log_level="error")
        writer.send(None)
        for frame in pixels:
            writer.send(np.ascontiguousarray(frame))
        writer.close()

    return files.write_atomic(path, encode, suffix=path.suffix)


def show_frames(frames: np.ndarray, title: str, count: int = 5, picture: np.ndarray | None = None) -> None:
    """Plot `count` frames spread evenly over the video in one row, with `title` above them
    (matplotlib; in a notebook the figure is stored as a PNG output); `picture` (image-to-video's
    input, any size) first, at its own aspect. Notebooks `cogvideox_pipeline` and `hunyuan_video`."""
    import matplotlib.pyplot as plt

    picks = np.linspace(0, len(frames) - 1, count).astype(int)
    panels = ([("the picture", picture)] if picture is not None else []) + [(f"frame {k}", frames[k]) for k in picks]
    fig, axes = plt.subplots(1, len(panels), figsize=(2 * len(panels), 2.2))
    for ax, (name, image) in zip(np.atleast_1d(axes), panels):
        ax.imshow(image)
        ax.set_title(name, fontsize=9)
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    plt.tight_layout()
    plt.show()
