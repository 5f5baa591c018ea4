"""Checkpoints on disk, the same way for every family.

One loading path for both presets: `from_pretrained(..., use_safetensors=True)` on a diffusers
directory or hub id. The tiny preset first writes a random pipeline with `save_pretrained`
(safetensors) into a cache folder named by everything that shapes it, so a changed config never
reuses a stale checkpoint. Introduced with the CogVideoX pipeline (notebook 07); HunyuanVideo-1.5
(notebook 09) uses the same functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from tpupedia import files
from tpupedia.errors import TpupediaError
from tpupedia.files import cache_dir

__all__ = ["CheckpointError", "cache_dir", "cached_pipeline", "clean_config", "choose_source", "named_source", "check_source",
           "source_label", "read_configs"]


class CheckpointError(TpupediaError, ValueError):
    """A checkpoint that cannot be used: no such folder, not a diffusers checkpoint, a hub id not
    downloaded while offline, a component config that is missing or unreadable."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a Hugging Face hub id looks like: OWNER/NAME."""

VOLATILE = {"_diffusers_version", "transformers_version", "_name_or_path", "_commit_hash", "_use_default_values"}
"""Config entries that record where or with which version a component was saved, not what it is."""


SPEC_STAMP = "tpupedia-checkpoint.txt"
"""The file in a written tiny checkpoint naming what it was built from (`cached_pipeline`): a folder
asked for another checkpoint is refused, not silently reused."""


def cached_pipeline(prefix: str, spec: Any, build: Callable[[], Any], directory: str | os.PathLike | None = None,
                    finish: Callable[[Path], None] | None = None) -> Path:
    """The directory of a pipeline written by `build().save_pretrained(...)`, reused when complete.

    Default directory: `cache_dir()/<prefix>-<sha256 of spec>`. Written to a temporary folder and
    renamed, so a crash leaves nothing half-written; a concurrent writer that wins the race is fine.
    `finish(folder)` runs on the written folder before the rename (e.g. to lay a tokenizer out in
    the files the real checkpoint ships, `tpupedia.models.tokenizer_files`).
    """
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    if directory is None:
        directory = cache_dir() / f"{prefix}-{digest}"
    path = Path(directory)
    if (path / "model_index.json").is_file():
        stamp = path / SPEC_STAMP
        if stamp.is_file() and stamp.read_text().strip() != f"{prefix}-{digest}":
            raise CheckpointError(f"{path} holds another tiny checkpoint ({stamp.read_text().strip()}), not "
                                  f"{prefix}-{digest}: give each checkpoint its own folder")
        return path
    pipe = build()

    def fill(tmp: Path) -> None:
        pipe.save_pretrained(tmp, safe_serialization=True)
        if finish is not None:
            finish(tmp)
        (tmp / SPEC_STAMP).write_text(f"{prefix}-{digest}\n")

    return files.directory_atomic(path, fill)


def clean_config(config: Any) -> dict:
    """A component config as a plain dict, without `VOLATILE` entries."""
    return {k: v for k, v in dict(config).items() if k not in VOLATILE}


def choose_source(preset: Any, model: str | os.PathLike | None, env_var: str, full_id: str,
                  tiny: Callable[[], Path]) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$<env_var>`, else the
    preset's (`full_id` for full; the tiny checkpoint, labelled `preset:<name>`). A chosen folder or
    hub id is checked first (`check_source`), so a wrong one is one clear error, not a download."""
    if model:
        check_source(str(model), "--model", full_id)
        return str(model), source_label(model)
    if os.environ.get(env_var):
        check_source(os.environ[env_var], f"${env_var}", full_id)
        return os.environ[env_var], source_label(os.environ[env_var])
    if preset.pretrained:
        check_source(full_id, f"the {preset.name} preset's checkpoint", full_id)
        return full_id, full_id
    return str(tiny()), f"preset:{preset.name}"


def source_label(source: str | os.PathLike) -> str:
    """How stage files name a checkpoint: a local folder by its resolved absolute path (so
    `DIR//ckpt`, `DIR/ckpt/` and a relative path to the same folder are one checkpoint), a hub
    id (`OWNER/NAME`, no such folder here) as given. A folder wins over a hub id of the same
    spelling, as it does for `from_pretrained`."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.is_dir() else str(source)


def named_source(model: str | os.PathLike | None, env_var: str) -> str | None:
    """The checkpoint the user named (`model`, else `$<env_var>`), or `None` for the preset's."""
    return str(model) if model else os.environ.get(env_var) or None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_source(source: str, what: str = "--model", example: str = "zai-org/CogVideoX1.5-5B") -> None:
    """Refuse, naming `source`, a checkpoint that cannot load: a folder without `model_index.json`,
    a file, a path that does not exist and is no hub id, or (with `HF_HUB_OFFLINE=1`) a hub id
    that is not in the local cache. Reads no weights."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise CheckpointError(f"{what} {source}: the folder has no model_index.json, so it is not a diffusers "
                                  f"pipeline checkpoint (write one with pipeline.save_pretrained(DIR), or give a hub "
                                  f"id such as {example})")
        return
    if path.exists():
        raise CheckpointError(f"{what} {source}: a file, not a checkpoint folder; give the folder that holds "
                              "model_index.json, or a hub id")
    if not HUB_ID.match(source):
        raise CheckpointError(f"{what} {source}: no such folder, and not a hub id (OWNER/NAME, e.g. {example})")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "model_index.json"), str):
            raise CheckpointError(f"{what} {source}: no such folder here, and with HF_HUB_OFFLINE=1 the hub id must be "
                                  f"in the local Hugging Face cache, which has no model_index.json for it (download "
                                  f"it first, e.g. huggingface-cli download {source} --local-dir DIR, then --model DIR)")


def read_configs(source: str, loaders: dict[str, Callable[[str], Any]]) -> dict[str, dict]:
    """`{component: config}` from `loaders[component](source)` (config files only, no weights),
    cleaned (`clean_config`); a missing or unreadable config is a `CheckpointError` naming it."""
    configs = {}
    for name, load in loaders.items():
        try:
            configs[name] = clean_config(load(source))
        except (OSError, ValueError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint {source}: cannot read the {name} config ({name}/config.json): "
                                  f"{first}") from None
    return configs
