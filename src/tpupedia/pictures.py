"""The picture a video starts from (`tpupedia generate FAMILY --image PICTURE`): checked before
any model loads, read as stock diffusers reads one, and fingerprinted.

`diffusers.utils.load_image`, which the stock image-to-video pipelines' examples use, opens the
file with Pillow, applies its EXIF orientation and converts it to RGB: a picture with alpha
loses the alpha channel (Pillow's `convert("RGB")` drops it, it does not composite), a grey one
is repeated over three channels, a palette one is expanded. `read` does exactly that (it calls
it), after `check` has refused what would fail later or take the host's memory: a path that is
missing, a folder, unreadable, not a picture Pillow can decode, or larger than `MAX_SIDE`
pixels a side. `fingerprint` (the SHA-256 of the file's bytes) goes into the stage files made
from the picture, so a changed picture makes them stale.

Introduced with image-to-video (`tpupedia generate FAMILY --image PICTURE`, for the families
whose pipeline has an `image` stage).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpupedia.errors import TpupediaError

__all__ = ["MAX_SIDE", "PictureError", "Picture", "check", "read", "fingerprint", "size"]

MAX_SIDE = 8192
"""The largest width or height accepted, in pixels: four times a 2K frame, and 8192 x 8192 RGB
(192 MiB decoded) is far below Pillow's decompression-bomb limit. Every model here resizes the
picture to the video's size (at most 1360 x 768 for the releases), so a larger one only costs
memory."""


class PictureError(TpupediaError, ValueError):
    """A `--image` that cannot be used: named, with what is allowed."""


@dataclass(frozen=True)
class Picture:
    """What `check` found: the file, its size and Pillow mode as stored, its format, its hash."""

    path: str
    width: int
    height: int
    mode: str
    format: str
    sha256: str

    @property
    def converted(self) -> str | None:
        """What reading it as RGB changes, in words (`None` when it is already RGB)."""
        if self.mode == "RGB":
            return None
        if "A" in self.mode or self.mode in ("PA", "P"):
            return f"{self.mode}: converted to RGB as diffusers' load_image does (any alpha dropped)"
        return f"{self.mode}: converted to RGB as diffusers' load_image does"


def _bytes(path: str | os.PathLike, flag: str) -> bytes:
    p = Path(path)
    if not p.exists():
        raise PictureError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise PictureError(f"{flag} {path}: is a folder, not a picture (give a PNG, JPEG or WebP file)")
    try:
        return p.read_bytes()
    except OSError as err:
        raise PictureError(f"{flag} {path}: cannot be read ({err.strerror or err})") from None


def fingerprint(path: str | os.PathLike) -> str:
    """The SHA-256 of the picture file's bytes (hex). Read once per version of the file (its
    inode, size and modification time in ns), though every stage's settings ask for it."""
    try:
        st = Path(path).stat()
    except OSError:
        return hashlib.sha256(_bytes(path, "picture")).hexdigest()  # raises the one-line error
    return _fingerprint(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, inode: int, size: int, mtime_ns: int) -> str:  # noqa: ARG001 - the cache key
    return hashlib.sha256(_bytes(path, "picture")).hexdigest()


def size(path: str | os.PathLike, flag: str = "--image") -> tuple[int, int]:
    """`(width, height)` of the picture as `read` returns it (EXIF orientation applied: a photo
    stored on its side and tagged to turn swaps them), from its header, once per version of the
    file; raises `check`'s errors for a picture that cannot be used."""
    try:
        st = Path(path).stat()
    except OSError:
        check(path, flag)  # raises the one-line error
        raise
    return _size(str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns, flag)


@functools.lru_cache(maxsize=64)
def _size(path: str, inode: int, size: int, mtime_ns: int, flag: str) -> tuple[int, int]:  # noqa: ARG001 - the cache key
    from PIL import Image

    picture = check(path, flag)
    with Image.open(path) as im:
        turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # the orientations that transpose
    return (picture.height, picture.width) if turned else (picture.width, picture.height)


def check(path: str | os.PathLike, flag: str = "--image") -> Picture:
    """Refuse a picture that cannot be used, naming `flag` and the path and saying what is
    allowed; else return what it is. Decodes the whole picture (a truncated file fails here, not
    in the middle of a run), after its header showed a size within `MAX_SIDE`; once per version of
    the file (its inode, size and modification time in ns): a batch checks each line's picture
    before JAX starts and again with the checkpoint's configs."""
    try:
        st = Path(path).stat()
    except OSError:
        return _check(str(path), flag)  # raises the one-line error
    return _checked(str(path), flag, str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _checked(path: str, flag: str, resolved: str, inode: int, size: int, mtime_ns: int) -> Picture:  # noqa: ARG001 - the cache key
    return _check(path, flag)


def _check(path: str, flag: str) -> Picture:
    from PIL import Image, UnidentifiedImageError

    data = _bytes(path, flag)
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise PictureError(f"{flag} {path}: not a picture Pillow can read (give a PNG, JPEG or WebP file)") from None
    with im:
        width, height, mode, kind = im.width, im.height, im.mode, im.format or "?"
        if width > MAX_SIDE or height > MAX_SIDE:
            raise PictureError(f"{flag} {path}: {width}x{height} pixels; at most {MAX_SIDE} a side is "
                               "accepted (the video is resized from it: scale it down first)")
        try:
            im.load()
        except (OSError, SyntaxError, ValueError) as err:
            raise PictureError(f"{flag} {path}: a {kind} file that does not decode ({err})") from None
    return Picture(str(path), width, height, mode, kind, hashlib.sha256(data).hexdigest())


def read(path: str | os.PathLike, flag: str = "--image") -> Any:
    """The picture as a PIL RGB image, read as `diffusers.utils.load_image` reads it (EXIF
    orientation applied, converted to RGB), after `check`."""
    from diffusers.utils import load_image

    check(path, flag)
    return load_image(str(path))
