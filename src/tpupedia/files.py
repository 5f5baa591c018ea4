"""The one way the package writes a file another run may read: atomically.

A reader never sees half a file: the content goes to a temporary file in the target's folder,
is flushed to disk, and is renamed onto the target (a rename within one file system is atomic);
if anything fails, the temporary file is removed and the old target, if any, is untouched. Stage
files, batch records, results files, videos, notebooks and tiny checkpoints are all written this
way. Introduced with the stage files of notebook `cogvideox_pipeline`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["cache_dir", "write_atomic", "write_text_atomic", "directory_atomic"]


def cache_dir() -> Path:
    """The package's cache folder: `$TPUPEDIA_CACHE`, or `~/.cache/tpupedia` (tiny checkpoints,
    plans, kept AOT compiles, JAX's compilation cache for the full preset)."""
    return Path(os.environ.get("TPUPEDIA_CACHE") or Path.home() / ".cache" / "tpupedia")


def write_atomic(target: str | os.PathLike, write: Callable[[Path], object], *, suffix: str = ".tmp") -> Path:
    """Call `write(temporary_path)`, flush the file to disk, then rename it onto `target`.

    `suffix` ends the temporary name, for writers that pick the format from it (an encoder's
    `.mp4`, jupytext's `.ipynb`). The file is made readable by all (`0644`), like any output."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_text_atomic(target: str | os.PathLike, text: str) -> Path:
    """`write_atomic` for a text file (UTF-8)."""
    return write_atomic(target, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def directory_atomic(target: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """Call `fill(temporary_directory)` and rename the directory onto `target`, which must not
    exist yet. If another process created `target` first, its copy wins and ours is removed
    (both were built from the same inputs); any other failure removes ours and is raised."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # not a concurrent writer that won the race
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
