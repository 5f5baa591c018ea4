"""Checkpoints on disk, the same way for every family.

One loading path for both presets: `from_pretrained(..., use_safetensors=True)` on a diffusers
directory or hub id. The tiny preset first writes a random pipeline with `save_pretrained`
(safetensors) into a cache folder named by everything that shapes it, so a changed config never
reuses a stale checkpoint. Introduced with the CogVideoX pipeline (notebook 06); HunyuanVideo-1.5
(notebook 07) uses the same functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["cache_dir", "cached_pipeline", "clean_config", "choose_source"]

VOLATILE = {"_diffusers_version", "transformers_version", "_name_or_path", "_commit_hash", "_use_default_values"}
"""Config entries that record where or with which version a component was saved, not what it is."""


def cache_dir() -> Path:
    """`$TPUPEDIA_CACHE`, or `~/.cache/tpupedia`."""
    return Path(os.environ.get("TPUPEDIA_CACHE") or Path.home() / ".cache" / "tpupedia")


def cached_pipeline(prefix: str, spec: Any, build: Callable[[], Any], directory: str | os.PathLike | None = None) -> Path:
    """The directory of a pipeline written by `build().save_pretrained(...)`, reused when complete.

    Default directory: `cache_dir()/<prefix>-<sha256 of spec>`. Written to a temporary folder and
    renamed, so a crash leaves nothing half-written; a concurrent writer that wins the race is fine.
    """
    if directory is None:
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
        directory = cache_dir() / f"{prefix}-{digest}"
    path = Path(directory)
    if (path / "model_index.json").is_file():
        return path
    pipe = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "model_index.json").is_file():  # not a concurrent writer that won the race
            raise
    return path


def clean_config(config: Any) -> dict:
    """A component config as a plain dict, without `VOLATILE` entries."""
    return {k: v for k, v in dict(config).items() if k not in VOLATILE}


def choose_source(preset: Any, model: str | os.PathLike | None, env_var: str, full_id: str,
                  tiny: Callable[[], Path]) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$<env_var>`, else the
    preset's (`full_id` for full; the tiny checkpoint, labelled `preset:<name>`)."""
    chosen = model or os.environ.get(env_var)
    if chosen:
        return str(chosen), str(chosen)
    if preset.pretrained:
        return full_id, full_id
    return str(tiny()), f"preset:{preset.name}"
