"""The picture given to `--image`: read exactly as diffusers' `load_image` reads it, and every bad
one refused in one line naming it, before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers.utils import load_image
from PIL import Image

from tpupedia import pictures


def _save(path, array):
    Image.fromarray(array).save(path)
    return path


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("channels, mode", [(3, "RGB"), (4, "RGBA"), (None, "L"), (2, "LA")])
def test_pictures_read_as_diffusers_load_image(tmp_path, rng, channels, mode):
    """RGB as it is; alpha dropped and grey repeated over three channels, as `load_image` does."""
    shape = (20, 30) if channels is None else (20, 30, channels)
    path = _save(tmp_path / "p.png", (rng.random(shape) * 255).astype(np.uint8))
    info = pictures.check(path)
    assert (info.width, info.height, info.mode, info.format) == (30, 20, mode, "PNG")
    assert (info.converted is None) == (mode == "RGB")
    got = pictures.read(path)
    assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(load_image(str(path))))


def test_exif_orientation_is_applied_as_diffusers_applies_it(tmp_path, rng):
    image = Image.fromarray((rng.random((10, 40, 3)) * 255).astype(np.uint8))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    got = pictures.read(path)
    assert got.size == (10, 40)  # displayed upright: width and height swap
    assert np.array_equal(np.asarray(got), np.asarray(load_image(str(path))))


def test_the_fingerprint_follows_the_bytes(tmp_path, rng):
    a = _save(tmp_path / "a.png", (rng.random((8, 8, 3)) * 255).astype(np.uint8))
    b = _save(tmp_path / "b.png", np.asarray(Image.open(a)).copy())
    assert pictures.fingerprint(a) == pictures.fingerprint(b) == pictures.check(a).sha256
    c = np.asarray(Image.open(a)).copy()
    c[0, 0, 0] ^= 1
    assert pictures.fingerprint(_save(tmp_path / "c.png", c)) != pictures.fingerprint(a)


def _bad(tmp_path, name):
    if name == "missing":
        return tmp_path / "nowhere.png", ["nowhere.png", "no such file"]
    if name == "folder":
        (tmp_path / "pics").mkdir()
        return tmp_path / "pics", ["pics", "is a folder"]
    if name == "text":
        (tmp_path / "notes.png").write_text("not a picture")
        return tmp_path / "notes.png", ["notes.png", "not a picture Pillow can read", "PNG, JPEG or WebP"]
    if name == "truncated":
        _save(tmp_path / "whole.png", np.full((64, 64, 3), 7, np.uint8))
        (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])
        return tmp_path / "cut.png", ["cut.png", "PNG file that does not decode"]
    if name == "too large":
        _save(tmp_path / "wide.png", np.zeros((1, pictures.MAX_SIDE + 1), np.uint8))
        return tmp_path / "wide.png", ["wide.png", f"{pictures.MAX_SIDE + 1}x1", f"at most {pictures.MAX_SIDE}"]
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["missing", "folder", "text", "truncated", "too large"])
def test_bad_pictures_are_refused_naming_the_file_and_what_is_allowed(tmp_path, name):
    path, names = _bad(tmp_path, name)
    with pytest.raises(pictures.PictureError) as err:
        pictures.check(path)
    message = str(err.value)
    assert message.startswith("--image ") and "\n" not in message
    for part in names:
        assert part in message, (part, message)


def test_an_unreadable_file_is_refused(tmp_path, monkeypatch):
    path = _save(tmp_path / "locked.png", np.zeros((4, 4, 3), np.uint8))
    monkeypatch.setattr(type(path), "read_bytes", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(pictures.PictureError, match="locked.png: cannot be read .Permission denied."):
        pictures.check(path)
